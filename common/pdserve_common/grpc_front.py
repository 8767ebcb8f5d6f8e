"""A per-address connection cap in front of a gRPC server: what grpc-python cannot do itself.

gRPC offers one global bound on connections (`grpc.max_allowed_incoming_connections`), so one
peer can take all of it, and it has no accept hook. So the public port is ours: an asyncio
listener that counts open connections per source address, closes a connection past `per_peer`
(or `total`) as soon as it is accepted, and splices every other one, byte for byte, to the gRPC
server on a unix socket in a private (0700) folder. TLS and HTTP/2 pass through untouched (gRPC
still terminates both, enforces its handshake and idle deadlines, and refuses a call without a
token from its headers). The cost is a copy of each message through the event loop: token
events and control calls, never KV (benchmarks/README.md, "gRPC per-peer cap").

Not an abstract socket: those have no permissions, so any process of the host's network
namespace could reach the inner server past both caps; a socket file in a folder only the
server's user can enter cannot be reached.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass, field

from pdserve_common import inherited_sockets
from pdserve_common.logs import kv

log = logging.getLogger(__name__)

PER_PEER_ENV = "PDSERVE_GRPC_MAX_CONNECTIONS_PER_PEER"
# The default share of one source address: a sixty-fourth of the front's total, at least 8.
PER_PEER_DIVISOR = 64
PER_PEER_FLOOR = 8
_CHUNK = 256 * 1024


@dataclass
class PeerCounts:
    """Open connections by source address, and what was refused (for tests and logs)."""

    open: dict[str, int] = field(default_factory=dict)
    refused_peer: int = 0
    refused_total: int = 0

    @property
    def total(self) -> int:
        return sum(self.open.values())


class PeerCappedFront:
    """Listens on `host:port` and splices accepted connections to `inner` (a unix socket's path,
    `inner_address`) while the source address holds fewer than `per_peer` of them and the front
    fewer than `total`."""

    def __init__(self, inner: str, per_peer: int, total: int) -> None:
        if per_peer < 1 or total < 1:
            raise ValueError(f"connection caps must be positive, got per_peer={per_peer} total={total}")
        self.inner, self.per_peer, self.total = inner, per_peer, total
        self.counts = PeerCounts()
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self, host: str, port: int) -> int:
        """Listen; the bound port (0 picks a free one). OSError if the address is taken."""
        sock = inherited_sockets.take(port)  # `pdserve local` bound it for us
        if sock is None:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            # Made with IPPROTO_TCP: asyncio then sets TCP_NODELAY on accepted sockets (a token
            # event must not wait for Nagle).
            sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((host, port))
            except OSError:
                sock.close()
                raise
        self._server = await asyncio.start_server(self._accepted, sock=sock, backlog=4096, limit=_CHUNK)
        return int(sock.getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        shutil.rmtree(os.path.dirname(self.inner), ignore_errors=True)  # (the gRPC server has stopped)

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = (writer.get_extra_info("peername") or ("unknown",))[0]
        counts = self.counts
        if counts.open.get(peer, 0) >= self.per_peer or counts.total >= self.total:
            if counts.open.get(peer, 0) >= self.per_peer:
                counts.refused_peer += 1
            else:
                counts.refused_total += 1
            writer.transport.abort()  # no goodbye: a flood costs us nothing more
            return
        counts.open[peer] = counts.open.get(peer, 0) + 1
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self._splice(reader, writer)
        finally:
            self._tasks.discard(task)
            left = counts.open[peer] - 1
            if left:
                counts.open[peer] = left
            else:
                del counts.open[peer]

    async def _splice(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            inner_reader, inner_writer = await asyncio.open_unix_connection(self.inner, limit=_CHUNK)
        except OSError as exc:
            log.warning(kv(event="grpc_front_inner_unreachable", inner=self.inner, error=repr(exc)))
            writer.transport.abort()
            return
        pumps = [
            asyncio.ensure_future(_pump(reader, inner_writer)),
            asyncio.ensure_future(_pump(inner_reader, writer)),
        ]
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            for w in (writer, inner_writer):
                w.transport.abort()


async def _pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    """Copy until end of stream (then half-close the other side) or an error."""
    try:
        while data := await source.read(_CHUNK):
            sink.write(data)
            await sink.drain()
        if sink.can_write_eof():
            sink.write_eof()
    except (ConnectionError, OSError):
        pass


def inner_address() -> str:
    """A fresh unix socket path for a gRPC server behind a front, in a new folder that only
    this process's user can enter (mkdtemp makes it 0700); the front removes it on close."""
    return os.path.join(tempfile.mkdtemp(prefix="pdserve-grpc-"), "grpc.sock")


def per_peer_from_env(total: int, env: dict[str, str] | None = None) -> int:
    """`PDSERVE_GRPC_MAX_CONNECTIONS_PER_PEER`, else a sixty-fourth of `total`, at least 8 (at most
    `total`): 16 of a worker's 1,024, 128 of the broker's 8,192. Why: a legitimate peer is one pod
    (a worker's routers, prefills, group members, operator; the broker's every pod) holding one or
    two channels, so 8 is several times its need, and a flood needs 64 addresses to fill a port."""
    raw = (os.environ if env is None else env).get(PER_PEER_ENV)
    if not raw:
        return min(total, max(PER_PEER_FLOOR, total // PER_PEER_DIVISOR))
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{PER_PEER_ENV} must be a positive integer, got {raw!r}") from None
    if value < 1:
        raise ValueError(f"{PER_PEER_ENV} must be a positive integer, got {value}")
    return value
