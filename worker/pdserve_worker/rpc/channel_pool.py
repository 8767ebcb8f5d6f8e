"""One gRPC channel per member endpoint, opened on first use and reused by every call after.

A channel multiplexes all calls to its endpoint over one HTTP/2 connection: opening one per
call would pay a TCP (and TLS) handshake each time. The pool is the channels' one owner:
`forget` takes a member's channel out when the member left the membership: the next call
opens a fresh one, while the calls already on it get `grace_s` to finish before the close
cancels them. A member "leaves" also when only the broker restarted (its watch starts over):
closing at once cancelled healthy prefills' calls in the middle of a prompt (the soak's broker
kills). A member really gone fails its calls on its own (the connection breaks: UNAVAILABLE).
`close` ends them all at shutdown.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

import grpc

from pdserve_common.auth import TLSConfig
from pdserve_common.channels import aio_channel


class ChannelPool:
    def __init__(
        self,
        token: str,
        tls: TLSConfig | None,
        spawn: Callable[[Coroutine[Any, Any, Any]], None],
        grace_s: float | None = None,
    ) -> None:
        self._token, self._tls, self._spawn, self._grace_s = token, tls, spawn, grace_s
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, endpoint: str) -> grpc.aio.Channel:
        channel = self._channels.get(endpoint)
        if channel is None:
            channel = self._channels[endpoint] = aio_channel(endpoint, self._token, self._tls)
        return channel

    def forget(self, endpoint: str, *, grace: bool = True) -> None:
        """The endpoint's member left: the next call opens a fresh channel; calls in flight on
        the old one may finish within the grace (none when the member was found lost)."""
        channel = self._channels.pop(endpoint, None)
        if channel is not None:
            self._spawn(channel.close(grace=self._grace_s if grace else None))

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()

    def __len__(self) -> int:
        return len(self._channels)
