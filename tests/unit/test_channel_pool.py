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
