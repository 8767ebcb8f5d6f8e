"""The host engine's transfers: range checks, the choice of path, and the async requests' table.

A request whose every remote range lies in memory this process maps is copied through the
mapping (the zero-copy path): on the caller's thread up to `inline_copy_max_bytes` (or when
the caller waits anyway), else on a copy thread. Any other request is a frame on the link
(the TCP path). An async request stays in the table until its terminal status was read once;
at most `max_outstanding` are held (RESOURCE_EXHAUSTED past that).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

from pdserve_common.logs import kv
from pdserve_worker.transfer import hixl_api as api
from pdserve_worker.transfer.backends.host import wire
from pdserve_worker.transfer.backends.host.batch_copy import BatchCopy
from pdserve_worker.transfer.backends.host.link import CopyStep, Link, Plan, Request
from pdserve_worker.transfer.backends.host.memory import MemoryTable
from pdserve_worker.transfer.backends.host.options import HostEngineOptions
from pdserve_worker.transfer.backends.host.regions import Region
from pdserve_worker.transfer.backends.host.shm import ShmSegment

log = logging.getLogger(__name__)

Descs = list[tuple[int, int, int]]  # (local_addr, remote_addr, len)


class _BadRange(ValueError):
    def __init__(self, side: str, addr: int, length: int) -> None:
        super().__init__(f"{side} range {addr:#x}+{length} is not inside a registered region")
        self.side, self.addr, self.length = side, addr, length


class TransferTable:
    """Starts transfers on their path and keeps the async ones until their status is read."""

    def __init__(self, lock: threading.RLock, memory: MemoryTable, link_of: Callable[[str], Link | None]) -> None:
        self._lock = lock
        self._memory = memory
        self._link_of = link_of  # the engine's lookup (it connects first under AutoConnect)
        self.options = HostEngineOptions()
        self._requests: dict[int, Request] = {}  # async requests not yet reported terminal
        self._req_ids = itertools.count(1)
        self._copy_queue: queue.SimpleQueue[tuple[Link, Request, Plan] | None] = queue.SimpleQueue()
        self._copy_threads: list[threading.Thread] = []

    # ---- the copy threads ----------------------------------------------------------------------------
    def start(self, options: HostEngineOptions) -> None:
        self.options = options
        for i in range(options.copy_threads):
            t = threading.Thread(target=self._copy_loop, name=f"hixl-copy-{i}", daemon=True)
            t.start()
            self._copy_threads.append(t)

    def stop_threads(self) -> None:
        for _ in self._copy_threads:
            self._copy_queue.put(None)
        for t in self._copy_threads:
            t.join(2.0)
        self._copy_threads.clear()

    def fail_all(self) -> None:
        """At finalize (lock held): every request not yet reported ends FAILED and is forgotten."""
        for req in self._requests.values():
            req.finish(api.FAILED)
        self._requests.clear()

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

    # ---- starting a transfer -------------------------------------------------------------------------
    def full(self) -> bool:
        with self._lock:
            return len(self._requests) >= self.options.max_outstanding

    def start_request(
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
        link = self._link_of(remote_engine)
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

    def _resolve(self, link: Link, op_descs: Sequence[Any]) -> tuple[Descs, Plan | None]:
        """Range-check every descriptor (raises _BadRange). Returns the descriptors as tuples
        and, when every remote range lies in memory this process maps, the copy plan of the
        zero-copy path (else None: the TCP path).

        Written for speed: a push's runs all fall in one local and one remote region, so that
        case is checked for the whole batch at once (`_resolve_within`); otherwise the regions
        of the previous descriptor are tried first."""
        fast = self._resolve_within(link, op_descs)
        if fast is not None:
            return fast
        descs: Descs = []
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
                local_region = self._memory.regions.find(local, length)
                if local_region is None:
                    raise _BadRange("local", local, length)
                local_view = self._memory.view_of(local_region)
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

    def _resolve_within(self, link: Link, op_descs: Sequence[Any]) -> tuple[Descs, Plan] | None:
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
        local_region = self._memory.regions.find(lo_local, hi_local - lo_local)
        remote_region = link.remote.find(lo_remote, hi_remote - lo_remote)
        if local_region is None or remote_region is None or not link.shares(remote_region):
            return None
        base, seg_base = local_region.addr, remote_region.shm_offset - remote_region.addr
        plan = BatchCopy(
            self._memory.view_of(local_region),
            base,
            link.peer_segment(remote_region),
            [a - base for a in locals_],
            [seg_base + b for b in remotes],
            lengths,
        )
        return [], plan

    # ---- the async requests' status ------------------------------------------------------------------
    def status(self, req_id: int) -> tuple[int, api.TransferStatus]:
        """A terminal state is reported once; after that (or for an id never issued) FAILED."""
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

    def wait(self, req_id: int, timeout_s: float) -> int:
        with self._lock:
            request = self._requests.get(req_id)
        if request is None:
            return api.FAILED
        return api.SUCCESS if request.wait(timeout_s) else api.TIMEOUT

    def all_status(self, args: Any) -> list[api.TransferResult]:
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
        return results

    def outstanding(self) -> int:
        with self._lock:
            return len(self._requests)
