"""A host-memory transfer engine with the HIXL Python binding's API and semantics.

`Hixl` here answers every method of `hixl.Hixl` (HIXL.md 2.1) with the same arguments, return
shapes and status codes, and never raises, so the code above the engine is one and the same
with real HIXL on Ascend and with this engine on plain CPUs:

- `initialize("ip:port", options)`: a port > 0 makes the engine a server listening there.
- `register_mem` before `connect`: a link sees the regions registered when it was made.
  A range outside a registered region, locally or remotely, is PARAM_INVALID.
- `transfer_async` returns a request id; `get_transfer_status` reports a terminal state once,
  then forgets the id (an unknown id is FAILED). At most `pdserve.MaxOutstandingTransfers`
  (default 4096, HIXL's CS flag queue) un-queried async requests: past that, RESOURCE_EXHAUSTED
  until the caller drains statuses.
- `send_notify` goes client→server only and returns once the server has queued it; the
  server queues at most `pdserve.NotifyQueueSize` (default 4096) notifies, past which the
  sender gets RESOURCE_EXHAUSTED; `get_notifies` drains the queue.

How bytes move. Memory that this engine allocated (`malloc_mem`, like ADXL's `MallocMem`) is a
POSIX shared-memory segment. At connect the client learns the server's regions with their
segment names and, when it can open them (same host, same /dev/shm), maps them: a transfer
into such a region is then one memmove per descriptor into the mapping and the server is not
involved at all (the zero-copy path). The notify that follows goes over the link's socket
after the copies returned, so the peer never sees "ready" before the bytes. Any other registered memory, a server on another host, or the
option `{"pdserve.Transport": "tcp"}` takes the TCP path: the frame goes to the server, which
checks the range and receives the bytes straight into the registered memory.

Who may use the engine (transfer/backends/host/server.py, link_auth.py, leases.py; all off by default, which is
HIXL's own behaviour, and all set by a pdserve worker, service_link.py):
- `pdserve.AuthKey` (hex): a link is admitted only after both ends prove, by HMAC
  challenge-response, that they hold this key; until then the server tells a peer nothing but
  a nonce and bounds what it reads (`pdserve.HandshakeTimeoutMs`, default 5000; at most
  `pdserve.MaxLinks`, default 256, links and 32 handshakes at once, a newcomer cutting the
  oldest handshake when all 32 are taken; one source address holds at most
  `pdserve.MaxHandshakesPerPeer`, default 8, of them, so a flood from one address can neither
  fill the handshake places nor keep evicting other peers' handshakes). With a key, the notify
  inbox also takes datagrams only from this process's user.
- `pdserve.RemoteWrite=leased`: peers WRITE only into ranges leased with `lease_write(addr,
  len)` (host-engine extension; `revoke_write(id)` ends one), else PARAM_INVALID.
- `pdserve.RemoteRead=0`: every remote READ is PARAM_INVALID.
- Always: at most 256 MiB per READ frame (a client refuses a bigger READ up front), 8 KiB
  per notify frame, 65,536 descriptors per frame. `security_stats()` counts the refusals.

Deliberate differences from real HIXL (all additive or host-only):
- `wait_transfer(req_id, timeout_s)` blocks until an async request is terminal, without
  consuming its status, so a pusher need not poll (it does with real HIXL).
- `wait_notifies(timeout_s)` blocks until a notify arrives (in `poll` on the inbox socket, no
  CPU while waiting). Real HIXL has only the draining `get_notifies`, so readiness polls it there.
- On one host a notify skips the server thread: it is one datagram to the server's inbox
  socket, accepted = queued (notify_inbox.py), so the waiter wakes one thread hop after the
  send. Over TCP it is a frame answered by an ACK, as in HIXL. The bound is then
  NotifyQueueSize plus the kernel's small datagram queue.
- `malloc_mem(size)` / `free_mem(addr)` are instance methods (ADXL's are static): the engine
  owns the segments so it can tell peers their names.
- No device memory: MEM_DEVICE registrations are accepted (the range check is the same) but
  the bytes are host bytes; `malloc_mem(MEM_DEVICE)` is UNSUPPORTED.
- Calls may come from any thread (real HIXL wants the thread with the ACL context).
- `connect_async` runs on one worker thread (FIFO for all remotes, not per remote).
- `get_all_transfer_status` works on every transport (real HIXL: only with LocalCommRes 1.3).
- "Async" shared-memory copies up to `pdserve.InlineCopyMaxBytes` (default 16 MiB) run on
  the caller's thread before `transfer_async` returns; bigger ones go to
  `pdserve.CopyThreads` copy threads (default 1). A memcpy is CPU work either way: on a
  host whose cores the model's compute keeps busy (the case this engine serves), a copy
  thread only competes with that compute and adds a hand-off, while a copy in the caller's
  thread costs exactly the copy (benchmarks/README.md has the figures). TCP frames up to
  `pdserve.InlineSendMaxBytes` (default 256 KiB) are written on the caller's thread when the
  socket is free; bigger ones by the link's sender thread, because a network send waits on
  the peer and that wait should overlap compute. Either way the status is read through
  `get_transfer_status`, exactly as for any async request.
- HIXL-specific options (BufferPool, RDMA, LocalCommRes, ...) are accepted and ignored.
- `finalize` stops the server (and joins its threads) before anything else, so no peer's
  frame is still writing into memory the owner frees next.

Threads: one acceptor when listening and one per accepted link (server side); per outgoing
link one ACK reader and one sender; the copy threads. All block in system calls or on
locks when idle, so an idle engine burns no CPU.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pdserve_common.logs import kv
from pdserve_worker.transfer import hixl_api as api
from pdserve_worker.transfer.backends.host import link_auth, wire
from pdserve_worker.transfer.backends.host.batch_copy import BatchCopy
from pdserve_worker.transfer.backends.host.link import CopyStep, Link, Plan, Request
from pdserve_worker.transfer.backends.host.netio import parse_engine_id
from pdserve_worker.transfer.backends.host.notify_inbox import NotifyInbox
from pdserve_worker.transfer.backends.host.regions import Region, RegionTable
from pdserve_worker.transfer.backends.host.server import HostServer, ServerPolicy
from pdserve_worker.transfer.backends.host.shm import ShmSegment
from pdserve_worker.transfer.base import TransferBackend
from pdserve_worker.transfer.copy_counts import CopyCounts
from pdserve_worker.transfer.leases import LeaseTable
from pdserve_worker.transfer.never_raises import never_raises

log = logging.getLogger("pdserve.transfer.host_engine")

OPTION_TRANSPORT = "pdserve.Transport"  # "auto" (shared memory where possible) | "tcp"
OPTION_MAX_OUTSTANDING = "pdserve.MaxOutstandingTransfers"
OPTION_NOTIFY_QUEUE = "pdserve.NotifyQueueSize"
OPTION_COPY_THREADS = "pdserve.CopyThreads"
OPTION_INLINE_COPY_MAX_BYTES = "pdserve.InlineCopyMaxBytes"
OPTION_INLINE_SEND_MAX_BYTES = "pdserve.InlineSendMaxBytes"
# Who may use the link, and for what (transfer/backends/host/server.py, link_auth.py, leases.py):
OPTION_AUTH_KEY = "pdserve.AuthKey"  # hex; both ends of a link must hold the same key
OPTION_REMOTE_WRITE = "pdserve.RemoteWrite"  # "registered" (HIXL) | "leased"
OPTION_REMOTE_READ = "pdserve.RemoteRead"  # "1" (HIXL) | "0"
OPTION_MAX_LINKS = "pdserve.MaxLinks"
OPTION_HANDSHAKE_TIMEOUT_MS = "pdserve.HandshakeTimeoutMs"
OPTION_MAX_HANDSHAKES_PER_PEER = "pdserve.MaxHandshakesPerPeer"

CONNECT_QUEUE_CAPACITY = 128  # HIXL's connect_pool.task_queue_capacity default


@dataclass(frozen=True)
class HostEngineOptions:
    """The host engine's own options, parsed from the string map `initialize` takes."""

    transport: str = "auto"
    max_outstanding: int = 4096
    notify_queue: int = 4096
    copy_threads: int = 1
    inline_copy_max_bytes: int = 16 << 20
    inline_send_max_bytes: int = 256 << 10
    auto_connect: bool = False
    auth_key: bytes | None = field(default=None, repr=False)
    remote_write: str = "registered"
    remote_read: bool = True
    max_links: int = 256
    handshake_timeout_ms: int = 5000
    max_handshakes_per_peer: int = 8

    @classmethod
    def parse(cls, options: dict[str, str]) -> HostEngineOptions:
        def positive(key: str, default: int, minimum: int = 1) -> int:
            raw = options.get(key)
            if raw is None:
                return default
            try:
                value = int(raw)
            except (TypeError, ValueError):
                raise ValueError(f"option {key} must be an integer, got {raw!r}") from None
            if value < minimum:
                raise ValueError(f"option {key} must be >= {minimum}, got {value}")
            return value

        transport = str(options.get(OPTION_TRANSPORT, "auto")).lower()
        if transport not in ("auto", "tcp"):
            raise ValueError(f"option {OPTION_TRANSPORT} must be 'auto' or 'tcp', got {transport!r}")
        auto_connect = str(options.get(api.OPTION_AUTO_CONNECT, "0"))
        if auto_connect not in ("0", "1"):
            raise ValueError(f"option {api.OPTION_AUTO_CONNECT} must be '0' or '1', got {auto_connect!r}")
        remote_write = str(options.get(OPTION_REMOTE_WRITE, "registered")).lower()
        if remote_write not in ("registered", "leased"):
            raise ValueError(f"option {OPTION_REMOTE_WRITE} must be 'registered' or 'leased', got {remote_write!r}")
        remote_read = str(options.get(OPTION_REMOTE_READ, "1"))
        if remote_read not in ("0", "1"):
            raise ValueError(f"option {OPTION_REMOTE_READ} must be '0' or '1', got {remote_read!r}")
        raw_key = options.get(OPTION_AUTH_KEY)
        auth_key = link_auth.parse_key(str(raw_key)) if raw_key else None
        return cls(
            transport=transport,
            max_outstanding=positive(OPTION_MAX_OUTSTANDING, cls.max_outstanding),
            notify_queue=positive(OPTION_NOTIFY_QUEUE, cls.notify_queue),
            copy_threads=positive(OPTION_COPY_THREADS, cls.copy_threads),
            inline_copy_max_bytes=positive(OPTION_INLINE_COPY_MAX_BYTES, cls.inline_copy_max_bytes, minimum=0),
            inline_send_max_bytes=positive(OPTION_INLINE_SEND_MAX_BYTES, cls.inline_send_max_bytes, minimum=0),
            auto_connect=auto_connect == "1",
            auth_key=auth_key,
            remote_write=remote_write,
            remote_read=remote_read == "1",
            max_links=positive(OPTION_MAX_LINKS, cls.max_links),
            handshake_timeout_ms=positive(OPTION_HANDSHAKE_TIMEOUT_MS, cls.handshake_timeout_ms),
            max_handshakes_per_peer=positive(OPTION_MAX_HANDSHAKES_PER_PEER, cls.max_handshakes_per_peer),
        )

    def server_policy(self) -> ServerPolicy:
        return ServerPolicy(
            key=self.auth_key,
            remote_write=self.remote_write,
            remote_read=self.remote_read,
            max_links=self.max_links,
            max_pending=min(32, self.max_links),
            max_pending_per_peer=min(self.max_handshakes_per_peer, 32, self.max_links),
            handshake_timeout_s=self.handshake_timeout_ms / 1000.0,
        )


F = TypeVar("F", bound=Callable[..., Any])


def _never_raises(failed: Callable[[], Any]) -> Callable[[F], F]:
    """The binding's contract (never_raises.py), logged on this engine's logger."""
    return never_raises(failed, log)


def _status(status: int) -> Callable[[], int]:
    return lambda: status


class _BadRange(ValueError):
    def __init__(self, side: str, addr: int, length: int) -> None:
        super().__init__(f"{side} range {addr:#x}+{length} is not inside a registered region")
        self.side, self.addr, self.length = side, addr, length


def get_capability(feature_type: int) -> tuple[int, int]:
    """Like `hixl.get_capability`: an unknown feature is SUCCESS with value 0."""
    if feature_type == api.FeatureType.AUTO_CONNECT:
        return api.SUCCESS, api.FEATURE_SUPPORTED
    return api.SUCCESS, api.FEATURE_NOT_SUPPORTED


class Hixl:
    """The host engine. See the module docstring for what it does and where it differs."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._initialized = False
        self.engine_id = ""
        self.options = HostEngineOptions()
        self._regions = RegionTable()
        self._segments: dict[int, ShmSegment] = {}  # malloc_mem's allocations by address
        self._links: dict[str, Link] = {}
        self._requests: dict[int, Request] = {}  # async requests not yet reported terminal
        self._req_ids = itertools.count(1)
        self._notifies: NotifyInbox | None = None
        self._server: HostServer | None = None
        self._copy_queue: queue.SimpleQueue[tuple[Link, Request, Plan] | None] = queue.SimpleQueue()
        self._views: dict[Region, memoryview] = {}
        self._copy_threads: list[threading.Thread] = []
        self._connector: ThreadPoolExecutor | None = None
        self._connect_status: dict[str, api.AsyncConnectStatus] = {}
        self._connect_queued = 0
        self._leases = LeaseTable()
        self.copies = CopyCounts()  # bytes per memory pass, this engine's own (copy_counts.py)

    # ---- lifecycle ---------------------------------------------------------------------------------
    @_never_raises(_status(api.FAILED))
    def initialize(self, local_engine: str, options: dict[str, str] | None = None) -> int:
        with self._lock:
            if self._initialized:
                return api.SUCCESS
            try:
                host, port = parse_engine_id(local_engine)
                self.options = HostEngineOptions.parse(dict(options or {}))
            except ValueError as exc:
                log.error(kv(event="initialize_rejected", engine=local_engine, error=exc))
                return api.PARAM_INVALID
            self._leases = LeaseTable()
            self._notifies = NotifyInbox(self.options.notify_queue, check_sender=self.options.auth_key is not None)
            inbox = self._notifies.name
            if port > 0:
                try:
                    self._server = HostServer(
                        host,
                        port,
                        local_engine,
                        self._regions,
                        self._notifies,
                        lambda: {"notify_socket": inbox},
                        self.options.server_policy(),
                        self._leases,
                        copies=self.copies,
                    )
                except OSError as exc:
                    log.error(kv(event="listen_failed", engine=local_engine, error=exc))
                    self._notifies.close()
                    return api.FAILED
                self._server.start()
            for i in range(self.options.copy_threads):
                t = threading.Thread(target=self._copy_loop, name=f"hixl-copy-{i}", daemon=True)
                t.start()
                self._copy_threads.append(t)
            self.engine_id = local_engine
            self._initialized = True
            log.info(
                kv(
                    event="engine_initialized",
                    backend="host",
                    engine=local_engine,
                    listening=port > 0,
                    transport=self.options.transport,
                    copy_threads=self.options.copy_threads,
                    auth=self.options.auth_key is not None,
                    remote_write=self.options.remote_write,
                    remote_read=self.options.remote_read,
                )
            )
            return api.SUCCESS

    @_never_raises(lambda: None)
    def finalize(self) -> None:
        with self._lock:
            if not self._initialized:
                return
            self._initialized = False
            links, self._links = list(self._links.values()), {}
            server, self._server = self._server, None
            connector, self._connector = self._connector, None
        # The server first: once it has stopped, no peer's frame can be writing into memory
        # that is about to be freed (its threads are joined); then our own links.
        if server is not None and not server.stop():
            log.error(kv(event="server_threads_linger", engine=self.engine_id))
        if connector is not None:
            connector.shutdown(wait=True, cancel_futures=True)
        for link in links:
            link.close(timeout_s=2.0)
        if self._notifies is not None:
            self._notifies.close()
        for _ in self._copy_threads:
            self._copy_queue.put(None)
        for t in self._copy_threads:
            t.join(2.0)
        self._copy_threads.clear()
        with self._lock:
            for req in self._requests.values():
                req.finish(api.FAILED)
            self._requests.clear()
            self._views.clear()
            for seg in self._segments.values():
                seg.close()
            self._segments.clear()
            self._regions = RegionTable()
        log.info(kv(event="engine_finalized", engine=self.engine_id))

    def __del__(self) -> None:  # the binding's destructor finalizes too
        try:
            self.finalize()
        except Exception:
            pass

    # ---- memory ------------------------------------------------------------------------------------
    @_never_raises(lambda: (api.FAILED, 0))
    def malloc_mem(self, size: int, mem_type: int = api.MemType.MEM_HOST) -> tuple[int, int]:
        """Shared memory a peer on this host can map (the zero-copy path). Zero-filled."""
        if not self._initialized:
            return api.FAILED, 0
        if mem_type != api.MemType.MEM_HOST:
            return api.UNSUPPORTED, 0
        if not isinstance(size, int) or size <= 0:
            return api.PARAM_INVALID, 0
        try:
            seg = ShmSegment.create(size)
        except OSError as exc:
            log.error(kv(event="malloc_failed", size=size, error=exc))
            return api.RESOURCE_EXHAUSTED, 0
        with self._lock:
            self._segments[seg.addr] = seg
        return api.SUCCESS, seg.addr

    @_never_raises(_status(api.FAILED))
    def free_mem(self, addr: int) -> int:
        """Free an allocation; its registrations go with it. Peers that mapped it keep valid
        (orphaned) pages. Like any HIXL memory, free it only once no transfer of ours uses it."""
        with self._lock:
            seg = self._segments.pop(addr, None)
            if seg is None:
                return api.PARAM_INVALID
            for region in self._regions.snapshot(include_local_only=True):
                if region.shm_name == seg.name:
                    handle = self._regions.handle_of(region)
                    if handle is not None:
                        self._regions.remove(handle)
                    self._views.pop(region, None)
        seg.close()
        return api.SUCCESS

    @_never_raises(lambda: (api.FAILED, 0))
    def register_mem(self, mem_desc: Any, mem_type: int) -> tuple[int, int]:
        if not self._initialized:
            return api.FAILED, 0
        addr, length = int(mem_desc.addr), int(mem_desc.len)
        if addr <= 0 or length <= 0 or int(mem_type) not in (api.MEM_DEVICE, api.MEM_HOST):
            return api.PARAM_INVALID, 0
        shm_name, shm_offset, shm_size = "", 0, 0
        with self._lock:
            for seg in self._segments.values():
                if seg.addr <= addr and addr + length <= seg.addr + seg.size:
                    shm_name, shm_offset, shm_size = seg.name, addr - seg.addr, seg.size
                    break
            region = Region(
                addr=addr,
                length=length,
                mem_type=int(mem_type),
                shm_name=shm_name,
                shm_offset=shm_offset,
                shm_size=shm_size,
                local_only=bool(getattr(mem_desc, "local_only", False)),
            )
            handle = self._regions.add(region)
        return api.SUCCESS, handle

    @_never_raises(_status(api.FAILED))
    def deregister_mem(self, handle: int) -> int:
        if not self._initialized:
            return api.FAILED
        if not handle:
            return api.PARAM_INVALID
        region = self._regions.remove(int(handle))  # unknown or repeated: SUCCESS, like HIXL
        if region is not None:
            self._views.pop(region, None)
        return api.SUCCESS

    # ---- links ---------------------------------------------------------------------------------------
    @_never_raises(_status(api.FAILED))
    def connect(self, remote_engine: str, timeout_in_millis: int = 1000) -> int:
        if not self._initialized:
            return api.FAILED
        if timeout_in_millis <= 0:
            return api.PARAM_INVALID
        with self._lock:  # the common case first: every push checks its targets are linked
            link = self._links.get(remote_engine)
            if link is not None and not link.closed:
                return api.ALREADY_CONNECTED
        try:
            host, port = parse_engine_id(remote_engine)
        except ValueError as exc:
            log.error(kv(event="connect_rejected", remote=remote_engine, error=exc))
            return api.PARAM_INVALID
        if port <= 0:
            return api.PARAM_INVALID
        try:
            new = Link.open(
                self.engine_id,
                remote_engine,
                host,
                port,
                timeout_in_millis / 1000.0,
                allow_shm=self.options.transport == "auto",
                inline_send_max_bytes=self.options.inline_send_max_bytes,
                key=self.options.auth_key,
                copies=self.copies,
            )
        except link_auth.AuthError as exc:
            log.warning(kv(event="connect_unauthenticated", remote=remote_engine, error=exc))
            return api.FAILED
        except TimeoutError as exc:
            log.warning(kv(event="connect_timeout", remote=remote_engine, timeout_ms=timeout_in_millis, error=exc))
            return api.TIMEOUT
        except OSError as exc:
            log.warning(kv(event="connect_failed", remote=remote_engine, error=exc))
            return api.FAILED
        stale: Link | None
        with self._lock:
            old = self._links.get(remote_engine)
            if old is not None and not old.closed:  # a concurrent connect won
                stale = new
            else:
                stale, self._links[remote_engine] = old, new
        if stale is not None:
            stale.close(timeout_s=1.0)
            if stale is new:
                return api.ALREADY_CONNECTED
        return api.SUCCESS

    @_never_raises(_status(api.FAILED))
    def disconnect(self, remote_engine: str, timeout_in_millis: int = 1000) -> int:
        if not self._initialized:
            return api.FAILED
        with self._lock:
            link = self._links.pop(remote_engine, None)
        if link is None:
            return api.NOT_CONNECTED
        link.close(timeout_s=max(timeout_in_millis, 1) / 1000.0)
        log.info(kv(event="disconnected", local=self.engine_id, remote=remote_engine))
        return api.SUCCESS

    @_never_raises(_status(api.FAILED))
    def connect_async(self, remote_engine: str, timeout_in_millis: int = 1000) -> int:
        return self._queue_connect(remote_engine, timeout_in_millis, connect=True)

    @_never_raises(_status(api.FAILED))
    def disconnect_async(self, remote_engine: str, timeout_in_millis: int = 1000) -> int:
        return self._queue_connect(remote_engine, timeout_in_millis, connect=False)

    def _queue_connect(self, remote_engine: str, timeout_ms: int, connect: bool) -> int:
        if not self._initialized:
            return api.FAILED
        if timeout_ms <= 0:
            return api.PARAM_INVALID
        S = api.AsyncConnectStatus
        with self._lock:
            if self._connect_queued >= CONNECT_QUEUE_CAPACITY:
                return api.RESOURCE_EXHAUSTED
            if self._connector is None:
                self._connector = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hixl-connect")
            self._connect_queued += 1
            self._connect_status[remote_engine] = S.CONNECT_PENDING if connect else S.DISCONNECT_PENDING
            connector = self._connector

        def task() -> None:
            try:
                with self._lock:
                    self._connect_status[remote_engine] = S.CONNECTING if connect else S.DISCONNECTING
                if connect:
                    ok = self.connect(remote_engine, timeout_ms) in (api.SUCCESS, api.ALREADY_CONNECTED)
                    result = S.CONNECTED if ok else S.CONNECT_FAILED
                else:
                    self.disconnect(remote_engine, timeout_ms)
                    result = S.NOT_CONNECT
                with self._lock:
                    self._connect_status[remote_engine] = result
            finally:
                with self._lock:
                    self._connect_queued -= 1

        connector.submit(task)
        return api.SUCCESS

    @_never_raises(lambda: (api.FAILED, api.AsyncConnectStatus.NOT_CONNECT))
    def get_async_connect_status(self, remote_engine: str) -> tuple[int, api.AsyncConnectStatus]:
        if not self._initialized:
            return api.FAILED, api.AsyncConnectStatus.NOT_CONNECT
        with self._lock:
            return api.SUCCESS, self._async_status(remote_engine)

    @_never_raises(lambda: (api.FAILED, {}))
    def get_all_async_connect_status(self) -> tuple[int, dict[str, api.AsyncConnectStatus]]:
        if not self._initialized:
            return api.FAILED, {}
        with self._lock:
            names = set(self._connect_status) | set(self._links)
            return api.SUCCESS, {name: self._async_status(name) for name in names}

    def _async_status(self, remote: str) -> api.AsyncConnectStatus:
        status = self._connect_status.get(remote)
        if status is not None:
            return status
        link = self._links.get(remote)
        connected = link is not None and not link.closed
        return api.AsyncConnectStatus.CONNECTED if connected else api.AsyncConnectStatus.NOT_CONNECT

    def _link(self, remote_engine: str) -> Link | None:
        with self._lock:
            link = self._links.get(remote_engine)
        if (link is None or link.closed) and self.options.auto_connect:
            if self.connect(remote_engine, 1000) in (api.SUCCESS, api.ALREADY_CONNECTED):
                with self._lock:
                    link = self._links.get(remote_engine)
        if link is None or link.closed:
            return None
        return link

    # ---- transfers -----------------------------------------------------------------------------------
    @_never_raises(_status(api.FAILED))
    def transfer_sync(self, remote_engine: str, op: int, op_descs: Sequence[Any], timeout_in_millis: int = 1000) -> int:
        if not self._initialized:
            return api.FAILED
        if timeout_in_millis <= 0:
            return api.PARAM_INVALID
        status, request = self._start(remote_engine, op, op_descs, api.TransferArgs(), sync=True)
        if request is None:
            return status
        if not request.wait(timeout_in_millis / 1000.0):
            # Like HIXL: the bytes may still land later; the caller should disconnect.
            log.warning(kv(event="transfer_timeout", remote=remote_engine, bytes=request.nbytes))
            return api.TIMEOUT
        return request.code

    @_never_raises(lambda: (api.FAILED, 0))
    def transfer_async(self, remote_engine: str, op: int, op_descs: Sequence[Any], args: Any = None) -> tuple[int, int]:
        if not self._initialized:
            return api.FAILED, 0
        with self._lock:
            if len(self._requests) >= self.options.max_outstanding:
                return api.RESOURCE_EXHAUSTED, 0
        status, request = self._start(remote_engine, op, op_descs, args or api.TransferArgs(), track=True)
        if request is None:
            return status, 0
        return api.SUCCESS, request.req_id

    def _start(
        self, remote_engine: str, op: int, op_descs: Sequence[Any], args: Any, track: bool = False, sync: bool = False
    ) -> tuple[int, Request | None]:
        """Validate, then hand the request to its path. (status, None) when refused up front.

        `sync`: the caller is going to wait anyway, so shared-memory copies run on its thread."""
        try:
            operation = api.TransferOp(int(op))
        except ValueError:
            return api.PARAM_INVALID, None
        if not op_descs:
            return api.PARAM_INVALID, None
        link = self._link(remote_engine)
        if link is None:
            return api.NOT_CONNECTED, None
        try:
            descs, plan = self._resolve(link, op_descs)
        except _BadRange as bad:
            log.warning(
                kv(
                    event="range_not_registered",
                    side=bad.side,
                    remote=remote_engine,
                    addr=hex(bad.addr),
                    len=bad.length,
                )
            )
            return api.PARAM_INVALID, None
        nbytes = plan.nbytes if isinstance(plan, BatchCopy) else None
        if plan is None and len(descs) > wire.MAX_DESCS_PER_FRAME:  # (the server would break the link)
            log.warning(
                kv(event="too_many_descriptors", remote=remote_engine, count=len(descs), limit=wire.MAX_DESCS_PER_FRAME)
            )
            return api.PARAM_INVALID, None
        request = Request(next(self._req_ids), operation, descs, int(getattr(args, "user_data", 0) or 0), nbytes=nbytes)
        if plan is None and operation is api.TransferOp.READ and request.nbytes > wire.MAX_READ_BYTES:
            log.warning(kv(event="read_too_big", remote=remote_engine, bytes=request.nbytes, limit=wire.MAX_READ_BYTES))
            return api.PARAM_INVALID, None
        if track:
            with self._lock:
                if len(self._requests) >= self.options.max_outstanding:
                    return api.RESOURCE_EXHAUSTED, None
                self._requests[request.req_id] = request
        if plan is None:
            link.submit(request)
        elif sync or request.nbytes <= self.options.inline_copy_max_bytes:
            link.copy(request, plan)
        else:
            self._copy_queue.put((link, request, plan))
        return api.SUCCESS, request

    def _resolve(self, link: Link, op_descs: Sequence[Any]) -> tuple[list[tuple[int, int, int]], Plan | None]:
        """Range-check every descriptor (raises _BadRange). Returns the descriptors as tuples
        and, when every remote range lies in memory this process maps, the copy plan of the
        zero-copy path (else None: the TCP path).

        Written for speed: a push's runs all fall in one local and one remote region, so that
        case is checked for the whole batch at once (`_resolve_within`); otherwise the regions
        of the previous descriptor are tried first."""
        fast = self._resolve_within(link, op_descs)
        if fast is not None:
            return fast
        descs: list[tuple[int, int, int]] = []
        plan: list[CopyStep] | None = []
        local_region: Region | None = None
        remote_region: Region | None = None
        local_view = memoryview(b"")
        segment: ShmSegment | None = None
        seg_base = 0
        for d in op_descs:
            local, remote, length = int(d.local_addr), int(d.remote_addr), int(d.len)
            if length <= 0:
                raise _BadRange("length", local, length)
            if local_region is None or not (local_region.addr <= local and local + length <= local_region.end):
                local_region = self._regions.find(local, length)
                if local_region is None:
                    raise _BadRange("local", local, length)
                local_view = self._view_of(local_region)
            if remote_region is None or not (remote_region.addr <= remote and remote + length <= remote_region.end):
                remote_region = link.remote.find(remote, length)
                if remote_region is None:
                    raise _BadRange("remote", remote, length)
                if plan is not None and link.shares(remote_region):
                    segment = link.peer_segment(remote_region)
                    seg_base = remote_region.shm_offset - remote_region.addr
                else:
                    plan = None
            descs.append((local, remote, length))
            if plan is not None:
                plan.append((local, local_view, local - local_region.addr, segment, seg_base + remote, length))  # type: ignore[arg-type]
        return descs, plan

    def _resolve_within(self, link: Link, op_descs: Sequence[Any]) -> tuple[list[tuple[int, int, int]], Plan] | None:
        """`_resolve` for a batch whose every range lies in one local region and one shared
        remote region: one bounds check over the batch's extremes instead of one per descriptor
        (a TP rank's head-sliced push sends thousands of 256-byte runs per call), and a
        BatchCopy of plain int lists, not a tuple per descriptor (the garbage collector's
        passes over 100,000 new tuples cost more than the copies). None when the batch is not
        that (then the per-descriptor path decides, and names what was wrong)."""
        locals_ = [d.local_addr for d in op_descs]
        remotes = [d.remote_addr for d in op_descs]
        lengths = [d.len for d in op_descs]
        if {*map(type, locals_), *map(type, remotes), *map(type, lengths)} != {int} or min(lengths) <= 0:
            return None
        lo_local, hi_local = min(locals_), max(map(sum, zip(locals_, lengths)))
        lo_remote, hi_remote = min(remotes), max(map(sum, zip(remotes, lengths)))
        local_region = self._regions.find(lo_local, hi_local - lo_local)
        remote_region = link.remote.find(lo_remote, hi_remote - lo_remote)
        if local_region is None or remote_region is None or not link.shares(remote_region):
            return None
        base, seg_base = local_region.addr, remote_region.shm_offset - remote_region.addr
        plan = BatchCopy(
            self._view_of(local_region),
            base,
            link.peer_segment(remote_region),
            [a - base for a in locals_],
            [seg_base + b for b in remotes],
            lengths,
        )
        return [], plan

    def _view_of(self, region: Region) -> memoryview:
        """A cached byte view of a local registered region (dropped when it is deregistered)."""
        view = self._views.get(region)
        if view is None:
            view = memoryview((ctypes.c_char * region.length).from_address(region.addr)).cast("B")
            self._views[region] = view
        return view

    def _copy_loop(self) -> None:
        while True:
            item = self._copy_queue.get()
            if item is None:
                return
            link, request, plan = item
            try:
                link.copy(request, plan)
            except Exception as exc:  # never let one bad copy kill the worker
                log.exception(kv(event="copy_failed", remote=link.remote_engine, error=repr(exc)))
                request.finish(api.FAILED)

    @_never_raises(lambda: (api.FAILED, api.TransferStatus.FAILED))
    def get_transfer_status(self, req_id: int) -> tuple[int, api.TransferStatus]:
        """A terminal state is reported once; after that (or for an id never issued) FAILED."""
        if not self._initialized:
            return api.FAILED, api.TransferStatus.FAILED
        with self._lock:
            request = self._requests.get(req_id)
            if request is None:
                return api.FAILED, api.TransferStatus.FAILED
            if request.status is api.TransferStatus.WAITING:
                return api.SUCCESS, api.TransferStatus.WAITING
            del self._requests[req_id]
        if request.status is api.TransferStatus.FAILED:
            log.warning(kv(event="transfer_failed", req=req_id, reason=api.status_name(request.code)))
        return api.SUCCESS, request.status

    @_never_raises(_status(api.FAILED))
    def wait_transfer(self, req_id: int, timeout_s: float) -> int:
        """Host-engine extension: block until an async request is terminal (SUCCESS) or
        timeout_s passed (TIMEOUT), without consuming its status; unknown id: FAILED. Lets a
        pusher sleep instead of polling; with real HIXL it polls `get_transfer_status`."""
        if not self._initialized:
            return api.FAILED
        with self._lock:
            request = self._requests.get(req_id)
        if request is None:
            return api.FAILED
        return api.SUCCESS if request.wait(timeout_s) else api.TIMEOUT

    @_never_raises(lambda: (api.FAILED, []))
    def get_all_transfer_status(self, args: Any = None) -> tuple[int, list[api.TransferResult]]:
        if not self._initialized:
            return api.FAILED, []
        args = args or api.GetTransferStatusArgs()
        results: list[api.TransferResult] = []
        with self._lock:
            for req_id in sorted(self._requests):
                if len(results) >= args.max_query_count:
                    break
                request = self._requests[req_id]
                waiting = request.status is api.TransferStatus.WAITING
                if waiting and args.skip_waiting:
                    continue
                results.append(api.TransferResult(req_id, request.user_data, request.status))
                if not waiting:
                    del self._requests[req_id]
        return api.SUCCESS, results

    # ---- notifies ------------------------------------------------------------------------------------
    @_never_raises(_status(api.FAILED))
    def send_notify(self, remote_engine: str, notify: Any, timeout_in_millis: int = 1000) -> int:
        if not self._initialized:
            return api.FAILED
        name, msg = str(notify.name), str(notify.notify_msg)
        if timeout_in_millis <= 0 or len(name) > api.MAX_NOTIFY_FIELD or len(msg) > api.MAX_NOTIFY_FIELD:
            return api.PARAM_INVALID
        link = self._link(remote_engine)
        if link is None:
            return api.NOT_CONNECTED
        name_bytes = name.encode()
        body = name_bytes + msg.encode()
        if link.notify_inbox(wire.notify_frame(body, len(name_bytes))):
            return api.SUCCESS  # same host: the decode's waiter is already being woken
        request = Request(0, None, [], body=body, name_len=len(name_bytes))
        link.notify(request)
        if not request.wait(timeout_in_millis / 1000.0):
            return api.TIMEOUT
        return request.code

    @_never_raises(lambda: (api.FAILED, []))
    def get_notifies(self) -> tuple[int, list[api.NotifyDesc]]:
        if not self._initialized or self._notifies is None:
            return api.FAILED, []
        return api.SUCCESS, self._notifies.drain()

    @_never_raises(lambda: (api.FAILED, []))
    def wait_notifies(self, timeout_s: float) -> tuple[int, list[api.NotifyDesc]]:
        """Host-engine extension: block until at least one notify is queued, then drain.

        (SUCCESS, [...]) when something arrived, (TIMEOUT, []) when nothing did in time.
        """
        if not self._initialized or self._notifies is None:
            return api.FAILED, []
        items = self._notifies.wait_drain(timeout_s)
        if not self._initialized:  # finalize() ran on another thread meanwhile
            return api.FAILED, items  # type: ignore[unreachable]
        return (api.SUCCESS, items) if items else (api.TIMEOUT, [])

    # ---- write leases (host engine only) -------------------------------------------------------------
    @_never_raises(lambda: (api.FAILED, 0))
    def lease_write(self, addr: int, length: int) -> tuple[int, int]:
        """Host-engine extension: let peers WRITE into [addr, addr+length) (with the option
        `pdserve.RemoteWrite=leased`, nothing else is writable). The range must lie in one
        registered region. Returns (status, lease id)."""
        if not self._initialized:
            return api.FAILED, 0
        addr, length = int(addr), int(length)
        if length <= 0 or self._regions.find(addr, length) is None:
            return api.PARAM_INVALID, 0
        return api.SUCCESS, self._leases.grant(addr, length)

    @_never_raises(_status(api.FAILED))
    def revoke_write(self, lease_id: int) -> int:
        """End a lease; unknown or repeated ids are SUCCESS (like deregister_mem)."""
        if not self._initialized:
            return api.FAILED
        self._leases.revoke(int(lease_id))
        return api.SUCCESS

    def copy_stats(self) -> dict[str, int]:
        """Host-engine extension: bytes this engine's CPU moved, per memory pass (copy_counts.py)."""
        return self.copies.snapshot()

    def security_stats(self) -> dict[str, int]:
        """Host engine only: what its server refused, by reason, and the links open now."""
        server = self._server
        stats = server.stats() if server is not None else {}
        return {**stats, "write_leases": len(self._leases)}

    # ---- introspection (host engine only) ------------------------------------------------------------
    def link_path(self, remote_engine: str) -> str | None:
        """'shm' when this engine maps some of the remote's memory, 'tcp' otherwise; None if unlinked."""
        with self._lock:
            link = self._links.get(remote_engine)
        if link is None or link.closed:
            return None
        return "shm" if any(link.shares(r) for r in link.remote.snapshot()) else "tcp"

    def outstanding(self) -> int:
        with self._lock:
            return len(self._requests)


def create() -> TransferBackend:
    """The registry's factory ("cpu"): HIXL's API on host memory, with the host-only extras."""
    engine = Hixl()
    return TransferBackend("cpu", engine, api, blocking=engine, host=engine)
