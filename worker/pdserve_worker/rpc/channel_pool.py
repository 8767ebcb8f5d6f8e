"""One gRPC channel per member endpoint, opened on first use and reused by every call after.

A channel multiplexes all calls to its endpoint over one HTTP/2 connection: opening one per
call would pay a TCP (and TLS) handshake each time. The pool is the channels' one owner:
`forget` takes a member's channel out when the member is gone (its close runs in the
background, after the calls on it have given up), `close` ends them all at shutdown.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

import grpc

from pdserve_common.auth import TLSConfig
from pdserve_common.channels import aio_channel


class ChannelPool:
    def __init__(self, token: str, tls: TLSConfig | None, spawn: Callable[[Coroutine[Any, Any, Any]], None]) -> None:
        self._token, self._tls, self._spawn = token, tls, spawn
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, endpoint: str) -> grpc.aio.Channel:
        channel = self._channels.get(endpoint)
        if channel is None:
            channel = self._channels[endpoint] = aio_channel(endpoint, self._token, self._tls)
        return channel

    def forget(self, endpoint: str) -> None:
        """The endpoint's member is gone: the next call opens a fresh channel."""
        channel = self._channels.pop(endpoint, None)
        if channel is not None:
            self._spawn(channel.close())

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()

    def __len__(self) -> int:
        return len(self._channels)
