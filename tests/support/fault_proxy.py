"""A TCP proxy that injects network faults: the soak's stand-in for a network that delays,
loses and resets (there is no netem on these machines).

One `FaultProxy` runs an asyncio loop in a thread and serves any number of *links*: a listening
address forwarding to an upstream one. Links are grouped by a name (a child of `pdserve local`:
every port it serves), and faults hit every link of a group, open connections and new ones alike:

- `delay(name, ms, seconds)`: each chunk waits `ms` before it is forwarded (latency; also what
  a lossy link looks like to TCP, whose retransmissions turn loss into delay);
- `stall(name, seconds)`: nothing is forwarded either way until it heals, new connections are
  accepted and held too (a partition that heals: the peers see silence, not an error, and TCP
  delivers everything afterwards, as it would after retransmitting);
- `reset(name)`: every open connection is aborted with a TCP RST (SO_LINGER 0), both sides;
- `flip(name, count, min_read)`: in each of the next `count` reads of at least `min_read` bytes
  going upstream (client to server) that hold WRITE payload of the host engine's framing, the
  middle byte of the longest payload run is inverted: a faulty NIC or a bit flip that TCP's
  checksum missed, in KV bytes and never in a frame header (`WritePayloads` follows the frames).

Counters per group (connections, bytes, resets, flipped) say what the faults met.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

CHUNK = 64 * 1024


@dataclass
class _Group:
    delay_s: float = 0.0
    delay_until: float = 0.0
    stall_until: float = 0.0
    connections: int = 0
    bytes: int = 0
    resets: int = 0
    flips_left: int = 0
    flip_min_read: int = 0
    flipped: int = 0
    open: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = field(default_factory=set)


class WritePayloads:
    """Follows one client→server stream of the host engine's framing (worker's
    transfer/backends/host/wire.py: header, then for WRITE `arg` descriptors and `size` payload
    bytes, else `size` body bytes) and says which bytes of each read are WRITE payload. A read
    may end or start anywhere in a frame, so the state carries over between reads."""

    def __init__(self) -> None:
        from pdserve_worker.transfer.backends.host import wire

        self._wire = wire
        self._header = b""
        self._sections: list[tuple[int, bool]] = []  # (bytes left, is payload), current first

    def spans(self, data: bytes) -> list[tuple[int, int]]:
        wire, out, i = self._wire, [], 0
        while i < len(data):
            if self._sections:
                left, payload = self._sections[0]
                take = min(left, len(data) - i)
                if payload:
                    out.append((i, i + take))
                i += take
                if take == left:
                    self._sections.pop(0)
                else:
                    self._sections[0] = (left - take, payload)
                continue
            need = wire.HEADER.size - len(self._header)
            self._header += data[i : i + need]
            i += min(need, len(data) - i)
            if len(self._header) == wire.HEADER.size:
                kind, arg, _, size = wire.HEADER.unpack(self._header)
                self._header = b""
                if kind == wire.Kind.WRITE:
                    self._sections = [(arg * wire.DESC.size, False), (size, True)]
                else:
                    self._sections = [(size, False)]
                self._sections = [s for s in self._sections if s[0]]
        return out


def _abort_with_rst(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


class FaultProxy:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._groups: dict[str, _Group] = {}
        self._servers: list[asyncio.Server] = []
        self._thread = threading.Thread(target=self.loop.run_forever, name="fault-proxy", daemon=True)
        self._thread.start()

    def _run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=10)

    def link(self, name: str, listen: tuple[str, int], upstream: tuple[str, int]) -> tuple[str, int]:
        """Forward `listen` (port 0: a free one) to `upstream`, as part of group `name`; returns
        the bound address."""
        group = self._groups.setdefault(name, _Group())

        async def start() -> tuple[str, int]:
            async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                await self._serve(group, upstream, reader, writer)

            server = await asyncio.start_server(handle, listen[0], listen[1], reuse_address=True)
            self._servers.append(server)
            host, port = server.sockets[0].getsockname()[:2]
            return host, port

        bound: tuple[str, int] = self._run(start())
        return bound

    async def _serve(
        self, group: _Group, upstream: tuple[str, int], reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        group.connections += 1
        await self._gate(group)
        try:
            up_reader, up_writer = await asyncio.open_connection(*upstream)
        except OSError:
            _abort_with_rst(writer)  # as the upstream refused: the client sees a reset
            return
        pair = (writer, up_writer)
        group.open.add(pair)
        try:
            await asyncio.gather(
                self._pump(group, reader, up_writer, upstream=True), self._pump(group, up_reader, writer)
            )
        finally:
            group.open.discard(pair)
            for w in pair:
                w.close()

    async def _gate(self, group: _Group) -> None:
        while (wait := group.stall_until - time.monotonic()) > 0:
            await asyncio.sleep(min(wait, 0.05))
        if group.delay_s and time.monotonic() < group.delay_until:
            await asyncio.sleep(group.delay_s)

    async def _pump(
        self, group: _Group, src: asyncio.StreamReader, dst: asyncio.StreamWriter, upstream: bool = False
    ) -> None:
        frames = WritePayloads() if upstream else None
        try:
            while data := await src.read(CHUNK):
                await self._gate(group)
                spans = frames.spans(data) if frames is not None else []
                if spans and group.flips_left and len(data) >= group.flip_min_read:
                    group.flips_left -= 1
                    group.flipped += 1
                    start, end = max(spans, key=lambda s: s[1] - s[0])
                    middle = (start + end) // 2
                    data = data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1 :]
                dst.write(data)
                await dst.drain()
                group.bytes += len(data)
            if dst.can_write_eof():
                dst.write_eof()
        except (ConnectionError, OSError):
            _abort_with_rst(dst)

    # ---- faults (callable from any thread) ---------------------------------------------------

    def delay(self, name: str, ms: float, seconds: float) -> None:
        g = self._groups[name]
        g.delay_s, g.delay_until = ms / 1000.0, time.monotonic() + seconds

    def stall(self, name: str, seconds: float) -> None:
        self._groups[name].stall_until = time.monotonic() + seconds

    def reset(self, name: str) -> int:
        """Abort every open connection of the group with RST; returns how many."""
        group = self._groups[name]

        async def abort() -> int:
            pairs = list(group.open)
            for pair in pairs:
                for w in pair:
                    _abort_with_rst(w)
            group.resets += len(pairs)
            return len(pairs)

        n: int = self._run(abort())
        return n

    def flip(self, name: str, count: int = 1, min_read: int = 16384) -> None:
        g = self._groups[name]
        g.flips_left, g.flip_min_read = count, min_read

    def counters(self) -> dict[str, dict[str, int]]:
        return {
            n: {"connections": g.connections, "bytes": g.bytes, "resets": g.resets, "flipped": g.flipped}
            for n, g in self._groups.items()
        }

    def close(self) -> None:
        async def shut() -> None:
            for server in self._servers:
                server.close()
            for group in self._groups.values():
                for pair in list(group.open):
                    for w in pair:
                        w.transport.abort()

        self._run(shut())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        self.loop.close()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: list[str] | None = None) -> None:
    """`python fault_proxy.py LISTEN=UPSTREAM ...` (host:port each): a relay without faults, until
    SIGTERM. The soak runs one inside its network namespace, so that links cross a veth pair
    that it can cut (benchmarks/soak.py --links netns)."""
    import argparse
    import signal

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("links", nargs="+", help="LISTEN_HOST:PORT=UPSTREAM_HOST:PORT")
    args = ap.parse_args(argv)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with FaultProxy() as proxy:
        for spec in args.links:
            listen, upstream = (part.rsplit(":", 1) for part in spec.split("="))
            proxy.link(spec, (listen[0], int(listen[1])), (upstream[0], int(upstream[1])))
        print("relaying", flush=True)
        stop.wait()


if __name__ == "__main__":
    main()
