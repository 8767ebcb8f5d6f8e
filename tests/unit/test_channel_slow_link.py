"""Our channels connect over a slow link: a handshake that takes longer than 100 ms is not a
dead peer. gRPC core reads `grpc.min_reconnect_backoff_ms` as the minimum connect timeout; at
the 100 ms it once had (pdserve_common/channels.py), a call over a link with 150 ms of delay
each way failed at once ("timed out before receiving SETTINGS frame"), and the soak at twice
the fault rate lost 416 of 1,000 requests that way (benchmarks/README.md)."""

from __future__ import annotations

import grpc
import pytest

from pdserve_common import channels
from support.fault_proxy import FaultProxy


async def call_through_slow_link(options: list[tuple[str, int]]) -> bytes:
    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request

    handler = grpc.method_handlers_generic_handler("t.T", {"Echo": grpc.unary_unary_rpc_method_handler(echo)})
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        with FaultProxy() as proxy:
            host, front = proxy.link("server", ("127.0.0.1", 0), ("127.0.0.1", port))
            proxy.delay("server", ms=150, seconds=60)
            async with grpc.aio.insecure_channel(f"{host}:{front}", options=options) as channel:
                reply: bytes = await channel.unary_unary("/t.T/Echo")(b"over a slow link", timeout=10)
                return reply
    finally:
        await server.stop(None)


@pytest.mark.asyncio
async def test_our_channel_options_connect_over_a_slow_link() -> None:
    options = channels.channel_options(None, channels.WORKER_MAX_MESSAGE)
    assert await call_through_slow_link(options) == b"over a slow link"


@pytest.mark.asyncio
async def test_a_100_ms_connect_timeout_fails_the_same_call() -> None:
    """The mechanism, shown: the option the channels no longer set fails this very call."""
    options = [*channels.channel_options(None, channels.WORKER_MAX_MESSAGE), ("grpc.min_reconnect_backoff_ms", 100)]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call_through_slow_link(options)
    assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
    assert "SETTINGS" in (caught.value.details() or "") or "timed out" in (caught.value.details() or "")
