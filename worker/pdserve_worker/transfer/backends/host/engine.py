"""A host-memory transfer engine with the HIXL Python binding's API and semantics.

`Hixl` answers every method of `hixl.Hixl` (HIXL.md 2.1) with the same arguments, return
shapes and status codes, and never raises, so the code above it is the same with real HIXL on
Ascend and with this engine on plain CPUs. Its parts: memory.py (allocations, registrations),
links.py (connect), transfers.py (the two paths, async requests), notify_inbox.py (notifies),
server.py (the listening side and whom it admits), options.py (the `pdserve.*` options).

Differences, all additive or host-only: `wait_transfer` and `wait_notifies` block instead of
polling; `lease_write`/`revoke_write` (leases.py), `copy_stats`, `security_stats`, `link_path`;
`malloc_mem`/`free_mem` are instance methods, host memory only (MEM_DEVICE bytes are host bytes);
calls may come from any thread; `connect_async` is FIFO on one thread; HIXL-only options are
accepted and ignored; `finalize` stops the server before it frees memory. On one host a notify
is one datagram to the peer's inbox (accepted = queued). An idle engine burns no CPU.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from pdserve_common.logs import kv
from pdserve_worker.transfer import hixl_api as api
from pdserve_worker.transfer.backends.host.link import Link
from pdserve_worker.transfer.backends.host.links import LinkTable
from pdserve_worker.transfer.backends.host.memory import MemoryTable
from pdserve_worker.transfer.backends.host.netio import parse_engine_id
from pdserve_worker.transfer.backends.host.notify_inbox import NotifyInbox
from pdserve_worker.transfer.backends.host.options import HostEngineOptions
from pdserve_worker.transfer.backends.host.server import HostServer, Served
from pdserve_worker.transfer.backends.host.transfers import TransferTable
from pdserve_worker.transfer.base import XXH3_64, TransferBackend
from pdserve_worker.transfer.copy_counts import CopyCounts
from pdserve_worker.transfer.leases import LeaseTable
from pdserve_worker.transfer.never_raises import never_raises

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])


def _never_raises(failed: Callable[[], Any]) -> Callable[[F], F]:
    """The binding's contract (never_raises.py), logged on this engine's logger."""
    return never_raises(failed, log)


def _status(status: int) -> Callable[[], int]:
    return lambda: status


def get_capability(feature_type: int) -> tuple[int, int]:
    """Like `hixl.get_capability`: an unknown feature is SUCCESS with value 0."""
    if feature_type == api.FeatureType.AUTO_CONNECT:
        return api.SUCCESS, api.FEATURE_SUPPORTED
    return api.SUCCESS, api.FEATURE_NOT_SUPPORTED


class Hixl:
    """The host engine. See the module docstring for what it does and where it differs."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # one lock, shared by the tables below
        self._initialized = False
        self.engine_id = ""
        self.options = HostEngineOptions()
        self._memory = MemoryTable(self._lock)
        self._links = LinkTable(self._lock)
        self._transfers = TransferTable(self._lock, self._memory, self._link)
        self._notifies: NotifyInbox | None = None
        self._server: HostServer | None = None
        self._leases = LeaseTable()
        self.copies = CopyCounts()  # bytes per memory pass, this engine's own (copy_counts.py)

    # ---- lifecycle ---------------------------------------------------------------------------------
    @_never_raises(_status(api.FAILED))
    def initialize(self, local_engine: str, options: dict[str, str] | None = None) -> int:
        """A port > 0 in "ip:port" makes the engine a server listening there."""
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
            if port > 0 and not self._listen(host, port, local_engine, self._notifies):
                return api.FAILED
            self._transfers.start(self.options)
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

    def _listen(self, host: str, port: int, local_engine: str, notifies: NotifyInbox) -> bool:
        inbox = notifies.name
        served = Served(self._memory.regions, notifies, lambda: {"notify_socket": inbox}, self._leases, self.copies)
        try:
            self._server = HostServer(host, port, local_engine, served, self.options.server_policy())
        except OSError as exc:
            log.error(kv(event="listen_failed", engine=local_engine, error=exc))
            notifies.close()
            return False
        self._server.start()
        return True

    @_never_raises(lambda: None)
    def finalize(self) -> None:
        with self._lock:
            if not self._initialized:
                return
            self._initialized = False
            links, connector = self._links.detach()
            server, self._server = self._server, None
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
        self._transfers.stop_threads()
        with self._lock:
            self._transfers.fail_all()
            self._memory.clear()
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
        return self._memory.malloc(size, mem_type)

    @_never_raises(_status(api.FAILED))
    def free_mem(self, addr: int) -> int:
        """Free an allocation; its registrations go with it. Peers that mapped it keep valid
        (orphaned) pages. Like any HIXL memory, free it only once no transfer of ours uses it."""
        return self._memory.free(addr)

    @_never_raises(lambda: (api.FAILED, 0))
    def register_mem(self, mem_desc: Any, mem_type: int) -> tuple[int, int]:
        """Register before `connect`: a link sees the regions registered when it was made."""
        if not self._initialized:
            return api.FAILED, 0
        return self._memory.register(mem_desc, mem_type)

    @_never_raises(_status(api.FAILED))
    def deregister_mem(self, handle: int) -> int:
        if not self._initialized:
            return api.FAILED
        return self._memory.deregister(handle)

    # ---- links ---------------------------------------------------------------------------------------
    @_never_raises(_status(api.FAILED))
    def connect(self, remote_engine: str, timeout_in_millis: int = 1000) -> int:
        if not self._initialized:
            return api.FAILED
        if timeout_in_millis <= 0:
            return api.PARAM_INVALID
        options = self.options.link_options(self.copies)
        return self._links.connect(self.engine_id, remote_engine, timeout_in_millis, options)

    @_never_raises(_status(api.FAILED))
    def disconnect(self, remote_engine: str, timeout_in_millis: int = 1000) -> int:
        if not self._initialized:
            return api.FAILED
        return self._links.disconnect(self.engine_id, remote_engine, timeout_in_millis)

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
        return self._links.queue(remote_engine, timeout_ms, self.connect if connect else None, self.disconnect)

    @_never_raises(lambda: (api.FAILED, api.AsyncConnectStatus.NOT_CONNECT))
    def get_async_connect_status(self, remote_engine: str) -> tuple[int, api.AsyncConnectStatus]:
        if not self._initialized:
            return api.FAILED, api.AsyncConnectStatus.NOT_CONNECT
        return api.SUCCESS, self._links.async_status(remote_engine)

    @_never_raises(lambda: (api.FAILED, {}))
    def get_all_async_connect_status(self) -> tuple[int, dict[str, api.AsyncConnectStatus]]:
        if not self._initialized:
            return api.FAILED, {}
        return api.SUCCESS, self._links.all_async_status()

    def _link(self, remote_engine: str) -> Link | None:
        link = self._links.get(remote_engine)
        if (link is None or link.closed) and self.options.auto_connect:
            if self.connect(remote_engine, 1000) in (api.SUCCESS, api.ALREADY_CONNECTED):
                link = self._links.get(remote_engine)
        if link is None or link.closed:
            return None
        return link

    # ---- transfers -----------------------------------------------------------------------------------
    @_never_raises(_status(api.FAILED))
    def transfer_sync(self, remote_engine: str, op: int, op_descs: Sequence[Any], timeout_in_millis: int = 1000) -> int:
        """A range outside a registered region, locally or remotely, is PARAM_INVALID."""
        if not self._initialized:
            return api.FAILED
        if timeout_in_millis <= 0:
            return api.PARAM_INVALID
        status, request = self._transfers.start_request(remote_engine, op, op_descs, api.TransferArgs(), sync=True)
        if request is None:
            return status
        if not request.wait(timeout_in_millis / 1000.0):
            # Like HIXL: the bytes may still land later; the caller should disconnect.
            log.warning(kv(event="transfer_timeout", remote=remote_engine, bytes=request.nbytes))
            return api.TIMEOUT
        return request.code

    @_never_raises(lambda: (api.FAILED, 0))
    def transfer_async(self, remote_engine: str, op: int, op_descs: Sequence[Any], args: Any = None) -> tuple[int, int]:
        """Returns a request id. At most `pdserve.MaxOutstandingTransfers` (HIXL's CS flag queue)
        requests whose terminal status was not read yet: past that, RESOURCE_EXHAUSTED."""
        if not self._initialized:
            return api.FAILED, 0
        if self._transfers.full():
            return api.RESOURCE_EXHAUSTED, 0
        status, request = self._transfers.start_request(
            remote_engine, op, op_descs, args or api.TransferArgs(), track=True
        )
        if request is None:
            return status, 0
        return api.SUCCESS, request.req_id

    @_never_raises(lambda: (api.FAILED, api.TransferStatus.FAILED))
    def get_transfer_status(self, req_id: int) -> tuple[int, api.TransferStatus]:
        """A terminal state is reported once; after that (or for an id never issued) FAILED."""
        if not self._initialized:
            return api.FAILED, api.TransferStatus.FAILED
        return self._transfers.status(req_id)

    @_never_raises(_status(api.FAILED))
    def wait_transfer(self, req_id: int, timeout_s: float) -> int:
        """Host-engine extension: block until an async request is terminal (SUCCESS) or
        timeout_s passed (TIMEOUT), without consuming its status; unknown id: FAILED. Lets a
        pusher sleep instead of polling; with real HIXL it polls `get_transfer_status`."""
        if not self._initialized:
            return api.FAILED
        return self._transfers.wait(req_id, timeout_s)

    @_never_raises(lambda: (api.FAILED, []))
    def get_all_transfer_status(self, args: Any = None) -> tuple[int, list[api.TransferResult]]:
        """Works on every transport (real HIXL: only with LocalCommRes 1.3)."""
        if not self._initialized:
            return api.FAILED, []
        return api.SUCCESS, self._transfers.all_status(args or api.GetTransferStatusArgs())

    # ---- notifies ------------------------------------------------------------------------------------
    @_never_raises(_status(api.FAILED))
    def send_notify(self, remote_engine: str, notify: Any, timeout_in_millis: int = 1000) -> int:
        """Client to server only; returns once the server queued it. Past `pdserve.NotifyQueueSize`
        queued notifies the sender gets RESOURCE_EXHAUSTED; `get_notifies` drains the queue."""
        if not self._initialized:
            return api.FAILED
        name, msg = str(notify.name), str(notify.notify_msg)
        if timeout_in_millis <= 0 or len(name) > api.MAX_NOTIFY_FIELD or len(msg) > api.MAX_NOTIFY_FIELD:
            return api.PARAM_INVALID
        link = self._link(remote_engine)
        if link is None:
            return api.NOT_CONNECTED
        return link.send_notify(name, msg, timeout_in_millis / 1000.0)

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
        if length <= 0 or self._memory.regions.find(addr, length) is None:
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
        return self._links.path(remote_engine)

    def outstanding(self) -> int:
        return self._transfers.outstanding()


def create() -> TransferBackend:
    """The registry's factory ("cpu"): HIXL's API on host memory, with the host-only extras."""
    engine = Hixl()
    return TransferBackend("cpu", engine, api, blocking=engine, host=engine, digest=XXH3_64)
