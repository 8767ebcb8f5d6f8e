"""What a client that never finishes its request can hold on a pdserve HTTP port: little, briefly.

uvicorn (h11) has no deadline for receiving a request (`timeout_keep_alive` only runs between
two requests, and any byte received cancels it), so a connection that sends nothing, or a header
line every few seconds (slowloris), was held for ever, each one a file descriptor: enough of them
starve the process (measured: benchmarks/README.md, "HTTP bounds"). `guarded_h11(limits)` is
uvicorn's h11 protocol with three bounds:
- `request_deadline_s`: a request must be received whole (head and body) within this many
  seconds of the connection opening or of the previous response's end, else the connection is
  closed; streaming a response is not limited;
- `max_connections`: connections beyond it are closed as soon as accepted (at most half the fds);
- `max_connections_per_peer`: the same per source address, so one client cannot take the whole
  cap (a router behind a proxy sees it as one peer: `PDSERVE_HTTP_MAX_CONNECTIONS_PER_PEER`).
All are counted by reason with a rate-limited summary line (util/drops.py), never one per connection.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from pdserve_worker.util.drops import DropCounter

log = logging.getLogger(__name__)

DEFAULT_REQUEST_DEADLINE_S = 30.0
DEFAULT_MAX_CONNECTIONS = 4096
# One address's default share of the cap: a sixteenth (256 of 4,096). At half, two addresses
# filled the router and every probe and other tenant failed for 40 s (#58 A2); at a sixteenth
# it takes 16 flooding addresses, each of which the cluster's NetworkPolicy or the front proxy
# can name.
PEER_SHARE = 16
_RECEIVED = (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.SWITCHED_PROTOCOL)


@dataclass(frozen=True)
class HttpLimits:
    request_deadline_s: float = DEFAULT_REQUEST_DEADLINE_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_connections_per_peer: int | None = None  # None: the cap / PEER_SHARE

    def effective_per_peer(self) -> int:
        cap = self.effective_max_connections()
        return max(1, min(cap, self.max_connections_per_peer or cap // PEER_SHARE))

    def effective_max_connections(self) -> int:
        """The cap, kept below half the process's descriptor limit (the rest is for everything
        else the process opens: gRPC, the transfer server, files)."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return self.max_connections
        return max(1, min(self.max_connections, soft // 2))


class _GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with the caps and the request deadline; `guarded_h11` makes one
    subclass per server, whose class attributes are that server's limits and its shared count
    of open connections by source address."""

    stats: DropCounter
    limits: HttpLimits
    cap: int
    peer_cap: int
    per_peer: dict[str, int]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._request_deadline: asyncio.TimerHandle | None = None
        self._peer: str | None = None  # set while this connection counts for its peer

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.cap:
            self.stats.count("connection_cap")
            transport.close()
            return
        peer = self.client[0] if self.client else "unknown"
        if self.per_peer.get(peer, 0) >= self.peer_cap:
            self.stats.count("peer_cap")
            transport.close()
            return
        self.per_peer[peer] = self.per_peer.get(peer, 0) + 1
        self._peer = peer
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._peer is not None:
            left = self.per_peer[self._peer] - 1
            if left:
                self.per_peer[self._peer] = left
            else:
                del self.per_peer[self._peer]
            self._peer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._settle()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request on this connection gets its own deadline
            self._settle()  # (it may have been pipelined and read already)

    def _settle(self) -> None:
        if self._request_deadline is not None and self.conn.their_state in _RECEIVED:
            self._disarm()

    def _arm(self) -> None:
        self._disarm()
        self._request_deadline = self.loop.call_later(self.limits.request_deadline_s, self._expired)

    def _disarm(self) -> None:
        if self._request_deadline is not None:
            self._request_deadline.cancel()
            self._request_deadline = None

    def _expired(self) -> None:
        self._request_deadline = None
        if not self.transport.is_closing():
            self.stats.count("request_deadline")
            self.transport.close()


def guarded_h11(limits: HttpLimits) -> type[H11Protocol]:
    """uvicorn's h11 protocol class with `limits` (see the module docstring); pass it as
    `uvicorn.Config(http=...)`. Each call is one server's: its own counts and drop summary."""
    cap = limits.effective_max_connections()
    peer_cap = limits.effective_per_peer()
    drops = DropCounter(
        log,
        "http_connections_closed",
        request_deadline_s=limits.request_deadline_s,
        max_connections=cap,
        max_connections_per_peer=peer_cap,
    )
    attributes = {"stats": drops, "limits": limits, "cap": cap, "peer_cap": peer_cap, "per_peer": {}}
    return type("GuardedH11Protocol", (_GuardedH11,), attributes)
