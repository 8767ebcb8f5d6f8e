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
import logging
import queue
import socket
import threading
import time
from dataclasses import dataclass, field

from pdserve_common.logs import kv
from pdserve_worker.transfer import hixl_api as api
from pdserve_worker.transfer.backends.host import link_auth, wire
from pdserve_worker.transfer.backends.host.batch_copy import BatchCopy, copy_run
from pdserve_worker.transfer.backends.host.netio import sendmsg_all
from pdserve_worker.transfer.backends.host.notify_inbox import abstract
from pdserve_worker.transfer.backends.host.regions import Region, RegionTable
from pdserve_worker.transfer.backends.host.shm import ShmSegment
from pdserve_worker.transfer.copy_counts import CopyCounts

log = logging.getLogger(__name__)

# One descriptor of a shared-memory copy: (local address, view of the local region, offset in
# it, the peer's segment as mapped here, offset in it, length).
CopyStep = tuple[int, memoryview, int, ShmSegment, int, int]
# A zero-copy request's plan: a step per descriptor, or one batch within one region each side.
Plan = list[CopyStep] | BatchCopy


_FINISH = threading.Lock()  # makes "first finisher wins" atomic across reader/closer threads


class Request:
    """One transfer (or notify) in flight. `code` is why it failed, for logs and transfer_sync.

    A plain slotted class with a bare lock as its completion signal: cheaper to create than a
    dataclass holding a threading.Event, and one is created per put."""

    __slots__ = ("req_id", "op", "descs", "user_data", "status", "code", "body", "name_len", "seq", "nbytes", "_done")

    def __init__(
        self,
        req_id: int,
        op: api.TransferOp | None,  # None: a notify frame
        descs: list[tuple[int, int, int]],  # (local_addr, remote_addr, len)
        user_data: int = 0,
        body: bytes = b"",  # a notify: name bytes then message bytes
        name_len: int = 0,
        nbytes: int | None = None,  # given when `descs` is left empty (a BatchCopy holds them)
    ) -> None:
        self.req_id = req_id
        self.op = op
        self.descs = descs
        self.user_data = user_data
        self.status = api.TransferStatus.WAITING
        self.code = api.SUCCESS
        self.body = body
        self.name_len = name_len
        self.seq = 0  # the frame's sequence number on its link, once sent
        self.nbytes = sum(d[2] for d in descs) if nbytes is None else nbytes
        self._done = threading.Lock()
        self._done.acquire()

    def finish(self, code: int) -> None:
        with _FINISH:
            if self.status is not api.TransferStatus.WAITING:
                return
            self.code = code
            self.status = api.TransferStatus.COMPLETED if code == api.SUCCESS else api.TransferStatus.FAILED
        self._done.release()

    def wait(self, timeout_s: float) -> bool:
        """Block until finished (True) or timeout_s passed (False)."""
        if self._done.acquire(timeout=max(0.0, timeout_s)):
            self._done.release()
            return True
        return False


@dataclass(frozen=True)
class LinkOptions:
    """How a link is made: whether it may map the peer's shared memory, the largest frame the
    caller's thread writes itself, the link key (None: no proof asked or given), the copy counts."""

    allow_shm: bool = True
    inline_send_max_bytes: int = 256 << 10
    key: bytes | None = field(default=None, repr=False)
    copies: CopyCounts = field(default_factory=CopyCounts)


@dataclass(frozen=True)
class _Opened:
    """What `Link.open` established: the socket and its frame reader, the peer's regions, our
    mappings of its shared ones, and its notify inbox when it is on this host."""

    sock: socket.socket
    reader: wire.FrameReader
    regions: list[Region]
    mappings: dict[str, ShmSegment]
    notify_socket: socket.socket | None = None


class Link:
    """A connected client→server link. Create with `Link.open`."""

    def __init__(self, local_engine: str, remote_engine: str, opened: _Opened, options: LinkOptions) -> None:
        self.local_engine = local_engine
        self.copies = options.copies
        self.remote_engine = remote_engine
        self.remote = RegionTable(opened.regions)
        self._sock = opened.sock
        self._frames = opened.reader
        self._mappings = opened.mappings
        self._inline_send_max = options.inline_send_max_bytes
        self._fast_notify = opened.notify_socket  # the server's notify inbox, when on this host
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
        cls, local_engine: str, remote_engine: str, host: str, port: int, timeout_s: float, options: LinkOptions
    ) -> Link:
        """Connect (retrying while the server is not up yet), authenticate, map shared regions.

        With `options.key` the server must prove it holds the same key before we use anything it
        said (we push KV into it, and KV gives a prompt away); without one we accept only a
        server that does not ask for a proof either. Raises TimeoutError when no server
        answered in time, link_auth.AuthError when the proofs fail, OSError/ProtocolError
        otherwise.
        """
        deadline = time.monotonic() + timeout_s
        sock = _connect_until(host, port, deadline)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            hello = _handshake(sock, local_engine, remote_engine, options.key)
            sock.settimeout(None)
        except TimeoutError:
            sock.close()
            raise TimeoutError(f"{remote_engine} accepted but did not finish the handshake in time") from None
        except BaseException:
            sock.close()
            raise
        reader, body = hello
        listed = body.get("regions", [])
        if not isinstance(listed, list):
            sock.close()
            raise ConnectionError(f"{remote_engine} sent regions that are not a list: {type(listed).__name__}")
        regions = [Region.from_wire(r) for r in listed]
        mappings: dict[str, ShmSegment] = {}
        inbox: socket.socket | None = None
        if options.allow_shm and body.get("host") == link_auth.host_tag():
            mappings = _map_shared(regions, remote_engine)
            inbox = _open_inbox(str(body.get("notify_socket", "")), remote_engine)
        log.info(
            kv(
                event="link_open",
                local=local_engine,
                remote=remote_engine,
                regions=len(regions),
                shared=len(mappings),
                path="shm" if mappings else "tcp",
                notify="inbox" if inbox else "tcp",
                auth=options.key is not None,
            )
        )
        return cls(local_engine, remote_engine, _Opened(sock, reader, regions, mappings, inbox), options)

    @property
    def closed(self) -> bool:
        return self._closed

    def shares(self, region: Region) -> bool:
        return region.shm_name in self._mappings

    # ---- the zero-copy path -----------------------------------------------------------------------
    def peer_segment(self, region: Region) -> ShmSegment:
        """Our mapping of the segment behind a shared remote region (see `shares`)."""
        return self._mappings[region.shm_name]

    def copy(self, request: Request, plan: Plan) -> None:
        """Copy every descriptor through our mapping of the peer's memory, on this thread
        (batch_copy.py: one rule per run, or a batch at once)."""
        with self._copies_cond:
            if self._closed:
                request.finish(api.NOT_CONNECTED)
                return
            self._copies += 1
        write = request.op is api.TransferOp.WRITE
        try:
            if isinstance(plan, BatchCopy):
                plan.run(write)
            else:
                for laddr, lview, loff, seg, poff, n in plan:
                    copy_run(lview, laddr - loff, loff, seg, poff, n, write)
            self.copies.add("memmove", request.nbytes)
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
        if request.nbytes <= self._inline_send_max and self._send_lock.acquire(blocking=False):
            try:
                self._send(request)
            finally:
                self._send_lock.release()
            return
        self._outbox.put(request)

    def send_notify(self, name: str, msg: str, timeout_s: float) -> int:
        """A notify to the server: one datagram to its inbox on this host, else a NOTIFY frame
        answered by an ACK within `timeout_s` (TIMEOUT otherwise)."""
        name_bytes = name.encode()
        body = name_bytes + msg.encode()
        if self.notify_inbox(wire.notify_frame(body, len(name_bytes))):
            return api.SUCCESS  # same host: the decode's waiter is already being woken
        request = Request(0, None, [], body=body, name_len=len(name_bytes))
        self.notify(request)
        if not request.wait(timeout_s):
            return api.TIMEOUT
        return request.code

    def notify_inbox(self, frame: bytes) -> bool:
        """On this host: send a NOTIFY frame as one datagram straight to the server's inbox,
        where the kernel wakes the waiting thread (one hop, no server thread involved).
        True when accepted (queued there: as good as HIXL's ACK); False when there is no inbox
        or it is full, and the caller takes the TCP path, which applies the real bound."""
        inbox = self._fast_notify
        if inbox is None or self._closed:
            return False
        try:
            inbox.send(frame, socket.MSG_DONTWAIT)
            return True
        except BlockingIOError:
            return False
        except OSError as exc:
            log.info(kv(event="notify_inbox_lost", remote=self.remote_engine, error=exc))
            self._fast_notify = None
            inbox.close()
            return False

    def notify(self, request: Request) -> None:
        """Send a notify frame over the link's socket from the caller's thread (it never waits
        behind queued data frames' hand-off); the server's ACK completes the request."""
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
                frame = [memoryview(wire.notify_frame(request.body, request.name_len, seq))]
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
            if request.op is api.TransferOp.WRITE:
                self.copies.add("socket_send", request.nbytes)
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
                kind, status, seq, size = self._frames.header()
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
                    self._frames.readinto([wire.memory(local, n) for local, _, n in request.descs])
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
            if item is None:  # the sender's stop sentinel is not ours to drop
                self._outbox.put(None)
                return
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
        if self._fast_notify is not None:
            self._fast_notify.close()
            self._fast_notify = None


def _handshake(
    sock: socket.socket, local_engine: str, remote_engine: str, key: bytes | None
) -> tuple[wire.FrameReader, dict[str, object]]:
    """The client side of HELLO → CHALLENGE → AUTH → HELLO_ACK (transfer/backends/host/server.py)."""
    client_nonce = link_auth.new_nonce()
    sock.sendall(wire.json_frame(wire.Kind.HELLO, {"v": 1, "nonce": client_nonce.hex()}))
    reader = wire.FrameReader(sock)
    kind, _, _, size = reader.header()
    if kind is not wire.Kind.CHALLENGE:
        raise wire.ProtocolError(f"expected CHALLENGE from {remote_engine}, got {kind.name}")
    challenge = reader.json(size, wire.MAX_HANDSHAKE_BODY)
    server_nonce = link_auth.parse_nonce(challenge.get("nonce"))
    server_auth = challenge.get("auth") is True
    if key is not None and not server_auth:
        raise link_auth.AuthError(f"{remote_engine} does not authenticate: refusing to push KV into it")
    if key is None and server_auth:
        raise link_auth.AuthError(f"{remote_engine} requires the service's link key, and this engine has none")
    host = link_auth.host_tag()
    auth: dict[str, object] = {"client": local_engine, "host": host}
    if key is not None:
        auth["proof"] = link_auth.client_proof(key, client_nonce, server_nonce, local_engine, host)
    sock.sendall(wire.json_frame(wire.Kind.AUTH, auth))
    try:
        kind, _, _, size = reader.header()
    except ConnectionError:
        # A server closes without a word when our proof is wrong (it tells an attacker nothing).
        raise link_auth.AuthError(f"{remote_engine} closed the link at AUTH: is this the same service's key?") from None
    if kind is not wire.Kind.HELLO_ACK:
        raise wire.ProtocolError(f"expected HELLO_ACK from {remote_engine}, got {kind.name}")
    body = reader.json(size)
    if key is not None:
        expected = link_auth.server_proof(key, client_nonce, server_nonce)
        if not link_auth.proofs_equal(expected, body.get("proof")):
            raise link_auth.AuthError(f"{remote_engine} sent a wrong proof: not this service's engine")
    return reader, body


def _connect_until(host: str, port: int, deadline: float) -> socket.socket:
    """TCP connect, retrying refusals (the server may still be starting) until the deadline."""
    last: OSError | None = None
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"no engine answered at {host}:{port} ({last or 'timed out'})")
        try:
            return socket.create_connection((host, port), timeout=remaining)
        except (TimeoutError, ConnectionRefusedError) as exc:
            last = exc
            time.sleep(min(0.01, max(0.0, deadline - time.monotonic())))


def _open_inbox(name: str, remote_engine: str) -> socket.socket | None:
    """A datagram socket connected to the server's notify inbox, or None when it is not
    reachable from here (another network namespace, or an older server without one)."""
    if not name.startswith("pdserve-hixl-notify-"):
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.connect(abstract(name))
    except OSError as exc:
        sock.close()
        log.info(kv(event="notify_inbox_unreachable", remote=remote_engine, reason=exc))
        return None
    return sock


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
