"""The client half of the host engine: one link to one remote engine, and the requests on it.

A link is a TCP connection (control and, when needed, data) plus, when the server is on this
host, mappings of the server's shared-memory regions. A request whose remote ranges all lie
in mapped regions is a plain memmove into the mapping (the zero-copy path: no server
involvement at all); any other request goes over the socket as one frame. Frames are written
under one lock by whichever thread sends (the caller for small frames, the link's sender
thread otherwise) and their ACKs are read by the link's reader thread, which completes them
in FIFO order.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import queue
import socket
import threading
import time
from dataclasses import dataclass, field

from pdserve_worker.logs import kv
from pdserve_worker.transfer import hixl_api as api
from pdserve_worker.transfer import wire
from pdserve_worker.transfer.netio import recvmsg_into_all, sendmsg_all
from pdserve_worker.transfer.regions import Region, RegionTable
from pdserve_worker.transfer.shm import ShmSegment, host_identity

log = logging.getLogger("pdserve.transfer.host_link")


@dataclass(eq=False)
class Request:
    """One transfer (or notify) in flight. `code` is why it failed, for logs and transfer_sync."""

    req_id: int
    op: api.TransferOp | None  # None: a notify frame
    descs: list[tuple[int, int, int]]  # (local_addr, remote_addr, len)
    user_data: int = 0
    status: api.TransferStatus = api.TransferStatus.WAITING
    code: int = api.SUCCESS
    done: threading.Event = field(default_factory=threading.Event)
    body: bytes = b""  # a notify's encoded frame body
    seq: int = 0  # the frame's sequence number on its link, once sent

    @property
    def nbytes(self) -> int:
        return sum(d[2] for d in self.descs)

    def finish(self, code: int) -> None:
        if self.done.is_set():
            return
        self.code = code
        self.status = api.TransferStatus.COMPLETED if code == api.SUCCESS else api.TransferStatus.FAILED
        self.done.set()


class Link:
    """A connected client→server link. Create with `Link.open`."""

    def __init__(
        self,
        local_engine: str,
        remote_engine: str,
        sock: socket.socket,
        remote_regions: list[Region],
        mappings: dict[str, ShmSegment],
        inline_max_bytes: int,
    ) -> None:
        self.local_engine = local_engine
        self.remote_engine = remote_engine
        self.remote = RegionTable(remote_regions)
        self._sock = sock
        self._mappings = mappings
        self._inline_max = inline_max_bytes
        self._send_lock = threading.Lock()
        self._pending: collections.deque[Request] = collections.deque()  # sent, awaiting ACK
        self._outbox: queue.SimpleQueue[Request | None] = queue.SimpleQueue()
        self._seq = 0
        self._closed = False
        self._closing = False  # a disconnect we asked for: losing the socket is expected
        self._copies = 0  # memmoves into our mappings running right now
        self._copies_cond = threading.Condition()
        self._reader = threading.Thread(target=self._read_loop, name=f"hixl-ack-{remote_engine}", daemon=True)
        self._sender = threading.Thread(target=self._send_loop, name=f"hixl-send-{remote_engine}", daemon=True)
        self._reader.start()
        self._sender.start()

    # ---- setup -------------------------------------------------------------------------------------
    @classmethod
    def open(
        cls,
        local_engine: str,
        remote_engine: str,
        host: str,
        port: int,
        timeout_s: float,
        allow_shm: bool,
        inline_max_bytes: int,
    ) -> "Link":
        """Connect (retrying while the server is not up yet), HELLO, map shared regions.

        Raises TimeoutError when no server answered in time; OSError/ProtocolError otherwise.
        """
        deadline = time.monotonic() + timeout_s
        sock = _connect_until(host, port, deadline)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            sock.sendall(wire.json_frame(wire.Kind.HELLO, {"client": local_engine, "host": host_identity()}))
            kind, _, _, size = wire.recv_header(sock)
            if kind is not wire.Kind.HELLO_ACK:
                raise wire.ProtocolError(f"expected HELLO_ACK from {remote_engine}, got {kind.name}")
            hello = wire.recv_json(sock, size)
            sock.settimeout(None)
        except socket.timeout:
            sock.close()
            raise TimeoutError(f"{remote_engine} accepted but did not answer HELLO in time") from None
        except BaseException:
            sock.close()
            raise
        regions = [Region.from_wire(r) for r in hello.get("regions", [])]  # type: ignore[union-attr]
        mappings: dict[str, ShmSegment] = {}
        if allow_shm and hello.get("host") == host_identity():
            mappings = _map_shared(regions, remote_engine)
        log.info(
            kv(
                event="link_open",
                local=local_engine,
                remote=remote_engine,
                regions=len(regions),
                shared=len(mappings),
                path="shm" if mappings else "tcp",
            )
        )
        return cls(local_engine, remote_engine, sock, regions, mappings, inline_max_bytes)

    @property
    def closed(self) -> bool:
        return self._closed

    def shares(self, region: Region) -> bool:
        return region.shm_name in self._mappings

    # ---- the zero-copy path -----------------------------------------------------------------------
    def peer_pointer(self, region: Region, remote_addr: int) -> int:
        seg = self._mappings[region.shm_name]
        return seg.addr + region.shm_offset + (remote_addr - region.addr)

    def copy(self, request: Request, pointers: list[int]) -> None:
        """memmove every descriptor through our mapping of the peer's memory.

        ctypes.memmove releases the GIL, so copies on worker threads run beside Python code.
        """
        with self._copies_cond:
            if self._closed:
                request.finish(api.NOT_CONNECTED)
                return
            self._copies += 1
        try:
            for (local, _, length), peer in zip(request.descs, pointers):
                if request.op is api.TransferOp.WRITE:
                    ctypes.memmove(peer, local, length)
                else:
                    ctypes.memmove(local, peer, length)
            request.finish(api.SUCCESS)
        finally:
            with self._copies_cond:
                self._copies -= 1
                self._copies_cond.notify_all()

    # ---- the TCP path ------------------------------------------------------------------------------
    def submit(self, request: Request) -> None:
        """Queue a frame. Small frames go out on the caller's thread when the socket is free:
        a thread hand-off costs more than sending a few hundred KB."""
        if self._closed:
            request.finish(api.NOT_CONNECTED)
            return
        if request.nbytes <= self._inline_max and self._send_lock.acquire(blocking=False):
            try:
                self._send(request)
            finally:
                self._send_lock.release()
            return
        self._outbox.put(request)

    def notify(self, request: Request) -> None:
        """Notifies never wait behind queued data frames' hand-off: they are sent right here."""
        if self._closed:
            request.finish(api.NOT_CONNECTED)
            return
        with self._send_lock:
            self._send(request)

    def _send(self, request: Request) -> None:
        """Write one frame; caller holds the send lock. A send error breaks the link."""
        if self._closed:
            request.finish(api.NOT_CONNECTED)
            return
        self._seq += 1
        seq = self._seq
        try:
            if request.op is None:
                frame = [memoryview(wire.header(wire.Kind.NOTIFY, 0, seq, len(request.body)) + request.body)]
            else:
                table = wire.pack_descs([(remote, length) for _, remote, length in request.descs])
                if request.op is api.TransferOp.WRITE:
                    hdr = wire.header(wire.Kind.WRITE, len(request.descs), seq, request.nbytes)
                    frame = [memoryview(hdr + table)] + [wire.memory(local, n) for local, _, n in request.descs]
                else:
                    frame = [memoryview(wire.header(wire.Kind.READ, len(request.descs), seq, 0) + table)]
            request.seq = seq
            self._pending.append(request)  # before sending: the ACK may beat us back
            sendmsg_all(self._sock, frame)
        except OSError as exc:
            self._break(f"send failed: {exc}")

    def _send_loop(self) -> None:
        while True:
            request = self._outbox.get()
            if request is None:
                return
            with self._send_lock:
                self._send(request)

    def _read_loop(self) -> None:
        try:
            while True:
                kind, status, seq, size = wire.recv_header(self._sock)
                if kind is not wire.Kind.ACK:
                    raise wire.ProtocolError(f"expected ACK, got {kind.name}")
                try:
                    request = self._pending.popleft()
                except IndexError:
                    raise wire.ProtocolError(f"ACK seq={seq} with nothing pending") from None
                if request.seq != seq:
                    raise wire.ProtocolError(f"ACK seq={seq} but the oldest pending frame is seq={request.seq}")
                if request.op is api.TransferOp.READ and status == api.SUCCESS:
                    if size != request.nbytes:
                        raise wire.ProtocolError(f"READ returned {size} bytes, asked {request.nbytes}")
                    recvmsg_into_all(self._sock, [wire.memory(local, n) for local, _, n in request.descs])
                request.finish(status)
        except (OSError, ConnectionError) as exc:
            self._break(f"connection lost: {exc}")
        except Exception as exc:
            log.error(kv(event="link_reader_failed", remote=self.remote_engine, error=repr(exc)))
            self._break(f"reader failed: {exc!r}")

    # ---- teardown ----------------------------------------------------------------------------------
    def _break(self, reason: str) -> None:
        """Fail everything in flight and mark the link unusable (disconnect still cleans up)."""
        if not self._closed and not self._closing:
            log.warning(kv(event="link_broken", local=self.local_engine, remote=self.remote_engine, reason=reason))
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        while self._pending:
            try:
                self._pending.popleft().finish(api.FAILED)
            except IndexError:
                break
        self._drain_outbox(api.FAILED)

    def _drain_outbox(self, code: int) -> None:
        while True:
            try:
                item = self._outbox.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                item.finish(code)

    def close(self, timeout_s: float) -> None:
        """Disconnect: fail what is still queued, wait for running copies, unmap, join threads."""
        deadline = time.monotonic() + timeout_s
        self._closing = True
        # A courtesy BYE, unless a sender is stuck on a peer that stopped reading.
        if not self._closed and self._send_lock.acquire(timeout=min(0.1, timeout_s)):
            try:
                self._sock.send(wire.header(wire.Kind.BYE), socket.MSG_DONTWAIT)
            except OSError:
                pass
            finally:
                self._send_lock.release()
        self._break("disconnect")
        self._outbox.put(None)
        with self._copies_cond:
            while self._copies and time.monotonic() < deadline:
                self._copies_cond.wait(max(0.0, deadline - time.monotonic()))
            copies_running = self._copies
        for t in (self._reader, self._sender):
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))
        self._sock.close()
        if copies_running:
            # Unmapping under a running memmove would crash the process: leak the mapping instead.
            log.error(kv(event="unmap_skipped", remote=self.remote_engine, copies_running=copies_running))
            return
        for seg in self._mappings.values():
            seg.close()
        self._mappings.clear()


def _connect_until(host: str, port: int, deadline: float) -> socket.socket:
    """TCP connect, retrying refusals (the server may still be starting) until the deadline."""
    last: OSError | None = None
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"no engine answered at {host}:{port} ({last or 'timed out'})")
        try:
            return socket.create_connection((host, port), timeout=remaining)
        except (ConnectionRefusedError, socket.timeout) as exc:
            last = exc
            time.sleep(min(0.01, max(0.0, deadline - time.monotonic())))


def _map_shared(regions: list[Region], remote_engine: str) -> dict[str, ShmSegment]:
    """Map every shared segment behind the server's regions; a segment we cannot see (another
    pod's /dev/shm) just leaves its regions on the TCP path."""
    mappings: dict[str, ShmSegment] = {}
    for region in regions:
        name = region.shm_name
        if not name or name in mappings:
            continue
        try:
            mappings[name] = ShmSegment.attach(name, region.shm_size)
        except (OSError, ValueError) as exc:
            log.info(kv(event="shm_not_shared", remote=remote_engine, shm=name, reason=exc))
    return mappings
