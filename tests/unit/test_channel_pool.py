"""rpc/channel_pool.ChannelPool: one channel per endpoint, reused; a forgotten one is closed and
replaced by a fresh one; close ends them all."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import grpc
import pytest

from pdserve_worker.rpc.channel_pool import ChannelPool


@pytest.mark.asyncio
async def test_one_channel_per_endpoint_reused_forgotten_and_closed() -> None:
    spawned: list[asyncio.Task[Any]] = []

    def spawn(coro: Coroutine[Any, Any, Any]) -> None:
        spawned.append(asyncio.get_running_loop().create_task(coro))

    pool = ChannelPool("token", None, spawn)
    a = pool.get("127.0.0.1:1")  # channels connect lazily: nothing listens there, nothing is dialled
    assert pool.get("127.0.0.1:1") is a and pool.get("127.0.0.1:2") is not a and len(pool) == 2
    pool.forget("127.0.0.1:1")
    await asyncio.gather(*spawned)
    assert a.get_state() is grpc.ChannelConnectivity.SHUTDOWN  # closed in the background
    assert pool.get("127.0.0.1:1") is not a  # the next call dials afresh
    pool.forget("127.0.0.1:9")  # an endpoint never used: nothing to close
    assert len(spawned) == 1
    b = pool.get("127.0.0.1:2")
    await pool.close()
    assert len(pool) == 0 and b.get_state() is grpc.ChannelConnectivity.SHUTDOWN


@pytest.mark.asyncio
async def test_a_forgotten_channel_lets_calls_in_flight_finish_unless_the_member_was_lost() -> None:
    """A member leaves the membership also when only the broker restarted: the call already on
    its channel (a prefill mid-prompt) must finish, not be cancelled by our own close. A member
    found lost (grace=False) has its calls cancelled at once."""

    async def slow(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await asyncio.sleep(0.5)
        return b"done:" + request

    handler = grpc.method_handlers_generic_handler("t.T", {"Slow": grpc.unary_unary_rpc_method_handler(slow)})
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    spawned: list[asyncio.Task[Any]] = []

    def spawn(coro: Coroutine[Any, Any, Any]) -> None:
        spawned.append(asyncio.get_running_loop().create_task(coro))

    try:
        pool = ChannelPool("token", None, spawn, grace_s=5.0)
        endpoint = f"127.0.0.1:{port}"

        def call() -> asyncio.Task[bytes]:
            return asyncio.ensure_future(pool.get(endpoint).unary_unary("/t.T/Slow")(b"x", timeout=5))

        kept = call()
        await asyncio.sleep(0.1)  # the call is on the wire
        pool.forget(endpoint)
        assert await kept == b"done:x"
        await asyncio.gather(*spawned)

        lost = call()
        await asyncio.sleep(0.1)
        pool.forget(endpoint, grace=False)
        with pytest.raises(asyncio.CancelledError):
            await lost  # gRPC ends a call on a channel closed under it as cancelled
        await asyncio.gather(*spawned)
    finally:
        await server.stop(None)
