"""A two-sided KV transport with HIXL's API: the baseline seed 002 measures one-sidedness against.

Point-to-point `send`/`recv` as collective libraries move tensors (torch.distributed over
gloo, whose calls are hccl's and nccl's): the receiver posts a receive into a staging buffer,
copies staging into the request's KV and acknowledges, so every chunk costs three memory
passes and the receiver's CPU (`copies`: `socket_send`; `socket_recv` + `staging_copy`).
Seed 002's baseline, served by a whole deployment (`pdserve local --transfer two-sided`), never
the default; gloo authenticates nobody, so it listens and connects on loopback only. A receiver writes only inside memory
registered with it; readiness still checks the grant's nonce.
Per pair: the decode's `initialize` opens a TCPStore; each connecting prefill takes the next
pair index and both build a 2-rank gloo group. `transfer_async(WRITE)` goes to the pair's
sender thread (header, descriptors, one in-place tensor each, then the receiver's ACK: one
chunk at a time); a notify takes the same road after the data. Unlike HIXL: WRITE only,
`connect` blocks until the decode joined, `wait_transfer`/`wait_notifies` block.
"""

from __future__ import annotations

import ctypes
import datetime
import ipaddress
import itertools
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from pdserve_common.logs import kv
from pdserve_worker.transfer import hixl_api as api
from pdserve_worker.transfer.backends.host.netio import parse_engine_id
from pdserve_worker.transfer.backends.host.regions import Region, RegionTable
from pdserve_worker.transfer.base import XXH3_64, TransferBackend
from pdserve_worker.transfer.copy_counts import CopyCounts
from pdserve_worker.transfer.never_raises import F, never_raises

log = logging.getLogger(__name__)

KIND_WRITE, KIND_NOTIFY, KIND_CLOSE = 1, 2, 3
TAG_HEADER, TAG_DESCS, TAG_DATA, TAG_ACK = 1, 2, 3, 4
MAX_DESCS = 65_536  # per transfer, as the host engine's frames
MAX_TRANSFER_BYTES = 1 << 30  # one transfer's payload: the staging buffer never grows past it
MAX_NOTIFY_BYTES = 8 << 10
MAX_OUTSTANDING = 4096  # un-queried async requests, as the host engine (HIXL's queue)
OPTION_TIMEOUT_MS = "pdserve.TwoSidedTimeoutMs"  # gloo's per-operation timeout (default 30000)
ACCEPT_POLL_S = 0.2
IDLE = datetime.timedelta(days=365)  # how long a receiver waits for a pair's next message


def _never_raises(failed: Callable[[], Any]) -> Callable[[F], F]:
    return never_raises(failed, log)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class _Request:
    """One queued write or notify; `done` is set once the receiver acknowledged (or it failed)."""

    __slots__ = ("req_id", "kind", "descs", "body", "name_len", "status", "code", "done")

    def __init__(self, req_id: int, kind: int, descs: list[tuple[int, int, int]], body: bytes = b"", name_len: int = 0):
        self.req_id = req_id
        self.kind = kind
        self.descs = descs  # (local address, remote address, length)
        self.body = body
        self.name_len = name_len
        self.status = api.TransferStatus.WAITING
        self.code = api.SUCCESS
        self.done = threading.Event()

    def finish(self, code: int) -> None:
        self.code = code
        self.status = api.TransferStatus.COMPLETED if code == api.SUCCESS else api.TransferStatus.FAILED
        self.done.set()


class _SendPair:
    """The prefill side of one pair: the process group and the thread that owns its sends."""

    def __init__(self, engine: TwoSidedEngine, remote: str, pg: Any, store: Any) -> None:
        self.remote, self.pg, self.store = remote, pg, store
        self.outbox: queue.Queue[_Request | None] = queue.Queue()
        self.broken = False
        self._engine = engine
        self._thread = threading.Thread(target=self._loop, name=f"two-sided-send-{remote}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        torch = _torch()
        while True:
            request = self.outbox.get()
            if request is None:
                if not self.broken:
                    try:  # tells the receiver's thread to end
                        self._send_header(torch, KIND_CLOSE, 0, 0, 0)
                    except Exception:
                        pass
                return
            if self.broken:
                request.finish(api.NOT_CONNECTED)
                continue
            try:
                request.finish(self._carry(torch, request))
            except Exception as exc:  # gloo raised: the peer is gone or timed out; the pair is dead
                log.warning(kv(event="two_sided_send_failed", remote=self.remote, error=repr(exc)))
                self.broken = True
                request.finish(api.FAILED)

    def _send_header(self, torch: Any, kind: int, count: int, nbytes: int, seq: int) -> None:
        header = torch.tensor([kind, count, nbytes, seq], dtype=torch.int64)
        self.pg.send([header], 0, TAG_HEADER).wait()

    def _carry(self, torch: Any, request: _Request) -> int:
        """Send one request and wait for the receiver's acknowledgement: its status."""
        if request.kind == KIND_NOTIFY:
            self._send_header(torch, KIND_NOTIFY, request.name_len, len(request.body), request.req_id)
            self.pg.send([torch.frombuffer(bytearray(request.body), dtype=torch.uint8)], 0, TAG_DATA).wait()
        else:
            nbytes = sum(d[2] for d in request.descs)
            self._send_header(torch, KIND_WRITE, len(request.descs), nbytes, request.req_id)
            where = torch.tensor([x for _, dst, n in request.descs for x in (dst, n)], dtype=torch.int64)
            self.pg.send([where], 0, TAG_DESCS).wait()
            works = [self.pg.send([_view(torch, src, n)], 0, TAG_DATA) for src, _, n in request.descs]
            for work in works:
                work.wait()
            self._engine.copies.add("socket_send", nbytes)
        ack = torch.zeros(2, dtype=torch.int64)
        self.pg.recv([ack], 0, TAG_ACK).wait()
        seq, code = ack.tolist()
        if seq != request.req_id:
            raise RuntimeError(f"acknowledgement for request {seq}, expected {request.req_id}")
        return int(code)

    def close(self) -> None:
        self.outbox.put(None)
        self._thread.join(timeout=5)


class _ReceivePair:
    """The decode side of one pair: receives into a staging buffer, copies into place, acks."""

    def __init__(self, engine: TwoSidedEngine, index: int, pg: Any) -> None:
        self.index, self.pg = index, pg
        self._engine = engine
        self._staging: Any = None
        self._thread = threading.Thread(target=self._loop, name=f"two-sided-recv-{index}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        torch = _torch()
        try:
            while self._serve_one(torch):
                pass
        except Exception as exc:  # the sender went away mid-transfer, or broke the protocol
            if not self._engine.stopping:
                log.warning(kv(event="two_sided_pair_closed", pair=self.index, error=repr(exc)))

    def _serve_one(self, torch: Any) -> bool:
        header = torch.zeros(4, dtype=torch.int64)
        # Idle between requests for as long as it takes: a gloo timeout would close the pair.
        self.pg.recv([header], 1, TAG_HEADER).wait(IDLE)
        kind, count, nbytes, seq = header.tolist()
        if kind == KIND_WRITE:
            code = self._write(torch, count, nbytes)
        elif kind == KIND_NOTIFY:
            code = self._notify(torch, count, nbytes)
        elif kind == KIND_CLOSE:
            return False
        else:
            raise ValueError(f"pair {self.index}: unknown message kind {kind}")
        self.pg.send([torch.tensor([seq, code], dtype=torch.int64)], 1, TAG_ACK).wait()
        return True

    def _write(self, torch: Any, count: int, nbytes: int) -> int:
        if not (0 < count <= MAX_DESCS and 0 < nbytes <= MAX_TRANSFER_BYTES):
            raise ValueError(f"pair {self.index}: write of {count} descriptors / {nbytes} bytes is out of bounds")
        where = torch.zeros(2 * count, dtype=torch.int64)
        self.pg.recv([where], 1, TAG_DESCS).wait()
        pairs = where.view(count, 2).tolist()
        if sum(n for _, n in pairs) != nbytes or any(n <= 0 for _, n in pairs):
            raise ValueError(f"pair {self.index}: descriptor lengths do not add up to {nbytes}")
        staging = self._staging_of(torch, nbytes)
        works, offset = [], 0
        for _, n in pairs:  # the receives are posted first, then matched to the sender's sends
            works.append(self.pg.recv([staging[offset : offset + n]], 1, TAG_DATA))
            offset += n
        for work in works:
            work.wait()
        self._engine.copies.add("socket_recv", nbytes)
        if not all(self._engine.registered(dst, n) for dst, n in pairs):
            self._engine.refused += 1
            return api.PARAM_INVALID
        base, offset = staging.data_ptr(), 0
        for dst, n in pairs:
            ctypes.memmove(dst, base + offset, n)
            offset += n
        self._engine.copies.add("staging_copy", nbytes)
        return api.SUCCESS

    def _staging_of(self, torch: Any, nbytes: int) -> Any:
        """The pair's staging buffer, grown to the largest transfer seen (bounded above)."""
        if self._staging is None or self._staging.numel() < nbytes:
            self._staging = torch.empty(nbytes, dtype=torch.uint8)
        return self._staging

    def _notify(self, torch: Any, name_len: int, nbytes: int) -> int:
        if not (0 <= name_len <= nbytes <= MAX_NOTIFY_BYTES):
            raise ValueError(f"pair {self.index}: notify of {nbytes} bytes (name {name_len}) is out of bounds")
        body = torch.zeros(max(nbytes, 1), dtype=torch.uint8)
        self.pg.recv([body[:nbytes] if nbytes else body], 1, TAG_DATA).wait()
        raw = bytes(body[:nbytes].numpy())
        self._engine.deliver(api.NotifyDesc(raw[:name_len].decode(), raw[name_len:].decode()))
        return api.SUCCESS


class TwoSidedEngine:
    """`hixl.Hixl`'s methods that pdserve calls, over gloo send/recv (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._notified = threading.Condition(self._lock)
        self._regions = RegionTable()
        self._senders: dict[str, _SendPair] = {}
        self._receivers: list[_ReceivePair] = []
        self._requests: dict[int, _Request] = {}
        self._req_ids = itertools.count(1)
        self._notifies: deque[api.NotifyDesc] = deque()
        self._store: Any = None
        self._accept: threading.Thread | None = None
        self._timeout = datetime.timedelta(seconds=30)
        self._initialized = False
        self.stopping = False
        self.refused = 0  # writes refused: a destination outside the registered regions
        self.copies = CopyCounts()
        self.engine_id = ""

    # ---- life cycle ------------------------------------------------------------------------------
    @_never_raises(lambda: api.FAILED)
    def initialize(self, local_engine: str, options: dict[str, str] | None = None) -> int:
        host, port = parse_engine_id(local_engine)
        if not _loopback(host):
            log.error(kv(event="two_sided_refused", engine=local_engine, reason="loopback addresses only"))
            return api.PARAM_INVALID
        timeout_ms = int((options or {}).get(OPTION_TIMEOUT_MS, 30000))
        if timeout_ms <= 0:
            return api.PARAM_INVALID
        self._timeout = datetime.timedelta(milliseconds=timeout_ms)
        if port > 0:
            dist = _torch().distributed
            self._store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=self._timeout)
            self._accept = threading.Thread(target=self._accept_loop, name="two-sided-accept", daemon=True)
            self._accept.start()
        self.engine_id = local_engine
        self._initialized = True
        log.info(kv(event="engine_initialized", backend="two-sided", engine=local_engine, listening=port > 0))
        return api.SUCCESS

    def _accept_loop(self) -> None:
        """Join each prefill that asked for a pair (`connect`), in order of their indexes."""
        dist = _torch().distributed
        for index in itertools.count():
            key = f"join/{index}"
            while not self.stopping:
                try:
                    if self._store.check([key]):
                        break
                except Exception:  # the store is closing
                    return
                self._sleep(ACCEPT_POLL_S)
            if self.stopping:
                return
            try:
                pg = _process_group(dist, dist.PrefixStore(f"pair/{index}/", self._store), 0, self._timeout)
            except Exception as exc:
                log.warning(kv(event="two_sided_join_failed", pair=index, error=repr(exc)))
                continue
            with self._lock:
                self._receivers.append(_ReceivePair(self, index, pg))

    def _sleep(self, seconds: float) -> None:
        with self._notified:
            self._notified.wait(seconds)

    @_never_raises(lambda: None)
    def finalize(self) -> None:
        with self._lock:
            if not self._initialized:
                return
            self._initialized = False
            self.stopping = True
            senders = list(self._senders.values())
            self._senders.clear()
            self._notified.notify_all()
        for pair in senders:
            pair.close()
        if self._accept is not None:
            self._accept.join(timeout=2)

    # ---- memory ----------------------------------------------------------------------------------
    @_never_raises(lambda: (api.FAILED, 0))
    def register_mem(self, mem_desc: Any, mem_type: int) -> tuple[int, int]:
        addr, length = int(mem_desc.addr), int(mem_desc.len)
        if addr <= 0 or length <= 0:
            return api.PARAM_INVALID, 0
        with self._lock:
            return api.SUCCESS, self._regions.add(Region(addr, length, int(mem_type)))

    @_never_raises(lambda: api.FAILED)
    def deregister_mem(self, handle: int) -> int:
        with self._lock:
            return api.SUCCESS if self._regions.remove(handle) is not None else api.PARAM_INVALID

    def registered(self, addr: int, length: int) -> bool:
        with self._lock:
            return self._regions.find(addr, length) is not None

    # ---- links -----------------------------------------------------------------------------------
    @_never_raises(lambda: api.FAILED)
    def connect(self, remote_engine: str, timeout_in_millis: int = 1000) -> int:
        host, port = parse_engine_id(remote_engine)
        if not self._initialized or port <= 0 or not _loopback(host):
            return api.PARAM_INVALID
        with self._lock:
            if remote_engine in self._senders and not self._senders[remote_engine].broken:
                return api.ALREADY_CONNECTED
        dist = _torch().distributed
        wait = datetime.timedelta(milliseconds=max(timeout_in_millis, 1))
        try:
            store = dist.TCPStore(host, port, is_master=False, timeout=wait)
            index = store.add("joins", 1) - 1
            store.set(f"join/{index}", "1")
            pg = _process_group(dist, dist.PrefixStore(f"pair/{index}/", store), 1, self._timeout)
        except Exception as exc:  # nobody listens there, or the decode did not join in time
            log.warning(kv(event="two_sided_connect_failed", remote=remote_engine, error=repr(exc)))
            return api.TIMEOUT
        with self._lock:
            self._senders[remote_engine] = _SendPair(self, remote_engine, pg, store)
        return api.SUCCESS

    @_never_raises(lambda: api.FAILED)
    def disconnect(self, remote_engine: str, timeout_in_millis: int = 1000) -> int:
        with self._lock:
            pair = self._senders.pop(remote_engine, None)
        if pair is None:
            return api.NOT_CONNECTED
        pair.close()
        return api.SUCCESS

    # ---- transfers -------------------------------------------------------------------------------
    @_never_raises(lambda: (api.FAILED, 0))
    def transfer_async(self, remote_engine: str, op: int, op_descs: Sequence[Any], args: Any = None) -> tuple[int, int]:
        if int(op) != api.TransferOp.WRITE:
            return api.UNSUPPORTED, 0
        descs = [(int(d.local_addr), int(d.remote_addr), int(d.len)) for d in op_descs]
        if not descs or len(descs) > MAX_DESCS or any(n <= 0 for _, _, n in descs):
            return api.PARAM_INVALID, 0
        if sum(n for _, _, n in descs) > MAX_TRANSFER_BYTES:
            return api.PARAM_INVALID, 0
        if not all(self.registered(src, n) for src, _, n in descs):
            return api.PARAM_INVALID, 0
        return self._enqueue(remote_engine, _Request(next(self._req_ids), KIND_WRITE, descs))

    def _enqueue(self, remote_engine: str, request: _Request) -> tuple[int, int]:
        with self._lock:
            pair = self._senders.get(remote_engine)
            if pair is None or pair.broken:
                return api.NOT_CONNECTED, 0
            if len(self._requests) >= MAX_OUTSTANDING:
                return api.RESOURCE_EXHAUSTED, 0
            self._requests[request.req_id] = request
        pair.outbox.put(request)
        return api.SUCCESS, request.req_id

    def transfer_sync(self, remote_engine: str, op: int, op_descs: Sequence[Any], timeout_in_millis: int = 1000) -> int:
        status, req_id = self.transfer_async(remote_engine, op, op_descs)
        if status != api.SUCCESS:
            return status
        if self.wait_transfer(req_id, timeout_in_millis / 1000) != api.SUCCESS:
            return api.TIMEOUT
        _, state = self.get_transfer_status(req_id)
        return api.SUCCESS if state == api.TransferStatus.COMPLETED else api.FAILED

    @_never_raises(lambda: (api.FAILED, api.TransferStatus.FAILED))
    def get_transfer_status(self, req_id: int) -> tuple[int, api.TransferStatus]:
        """A terminal state is reported once; after that (or for an id never issued) FAILED."""
        with self._lock:
            request = self._requests.get(req_id)
            if request is None:
                return api.FAILED, api.TransferStatus.FAILED
            if request.status is api.TransferStatus.WAITING:
                return api.SUCCESS, api.TransferStatus.WAITING
            del self._requests[req_id]
        return api.SUCCESS, request.status

    def wait_transfer(self, req_id: int, timeout_s: float) -> int:
        """Block until request `req_id` is terminal (without consuming its status)."""
        with self._lock:
            request = self._requests.get(req_id)
        if request is None:
            return api.FAILED
        return api.SUCCESS if request.done.wait(timeout_s) else api.TIMEOUT

    # ---- notifies --------------------------------------------------------------------------------
    @_never_raises(lambda: api.FAILED)
    def send_notify(self, remote_engine: str, notify: Any, timeout_in_millis: int = 1000) -> int:
        name, msg = str(notify.name).encode(), str(notify.notify_msg).encode()
        if len(name) + len(msg) > MAX_NOTIFY_BYTES:
            return api.PARAM_INVALID
        status, req_id = self._enqueue(
            remote_engine, _Request(next(self._req_ids), KIND_NOTIFY, [], name + msg, len(name))
        )
        if status != api.SUCCESS:
            return status
        done = self.wait_transfer(req_id, timeout_in_millis / 1000) == api.SUCCESS
        with self._lock:
            request = self._requests.pop(req_id)
        return request.code if done else api.TIMEOUT

    def deliver(self, notify: api.NotifyDesc) -> None:
        with self._notified:
            self._notifies.append(notify)
            self._notified.notify_all()

    @_never_raises(lambda: (api.FAILED, []))
    def get_notifies(self) -> tuple[int, list[api.NotifyDesc]]:
        with self._lock:
            items = list(self._notifies)
            self._notifies.clear()
        return api.SUCCESS, items

    def wait_notifies(self, timeout_s: float) -> tuple[int, list[api.NotifyDesc]]:
        """Like `get_notifies`, but sleeps up to `timeout_s` until one arrives (TIMEOUT if none)."""
        with self._notified:
            if not self._notifies:
                self._notified.wait(timeout_s)
            items = list(self._notifies)
            self._notifies.clear()
        return (api.SUCCESS, items) if items else (api.TIMEOUT, [])

    def copy_stats(self) -> dict[str, int]:
        return self.copies.snapshot()


def _process_group(dist: Any, store: Any, rank: int, timeout: datetime.timedelta) -> Any:
    """A 2-rank gloo group on loopback: this process is `rank` (decode 0, prefill 1)."""
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    options._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, 2, options)


def _view(torch: Any, addr: int, length: int) -> Any:
    """A uint8 tensor over `length` bytes at `addr` (registered memory), without copying."""
    return torch.frombuffer((ctypes.c_char * length).from_address(addr), dtype=torch.uint8)


def _torch() -> Any:
    import torch

    return torch


def create() -> TransferBackend:
    """The registry's factory ("two-sided"): the seed's send/recv baseline, never the default."""
    engine = TwoSidedEngine()
    return TransferBackend("two-sided", engine, api, blocking=engine, digest=XXH3_64)
