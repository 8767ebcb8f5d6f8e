"""Prefill's KV push: layer chunk by layer chunk, into every decode member that owns the layer.

`push_chunk(layers)` right after computing them: the puts go out asynchronously, so chunk k's
transfer overlaps chunk k+1's compute. One contiguous run per (layer, K|V) of the prompt's
tokens (a head slice's per-token pieces count as one run), in `transfer_async` requests of at
most `queue_depth` runs; per target at most `queue_depth` runs are outstanding. The engine's
RESOURCE_EXHAUSTED is waited out. A put that fails, or is pending after `timeout_s`, raises
`PushError` naming target and layers; on a timeout the target is disconnected (as HIXL advises).
`finish(extra)` waits for every put, then sends each target one `kv_ready` notify carrying
(request_id, slot, generation, nonce, num_tokens, **extra); the decode drops one without the
grant's nonce, and it travels after the data on the same link.
Targets are the decode's grants (`kv.slots.Grant`). A layer-sharded member's target gets only
its layers; a paged target is written through its block list, one descriptor per (layer, K|V,
run of consecutive blocks), never into its shared blocks (`push_runs`).
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

from pdserve_common.kv_layout import (
    BlockLayout,
    K,
    KVLayout,
    PushRoute,
    Strided,
    V,
    coalesce,
    push_runs,
    shared_heads,
)
from pdserve_common.logs import kv
from pdserve_worker.kv.slots import Grant
from pdserve_worker.transfer.base import TransferBackend, TransferError
from pdserve_worker.transfer.digest import DIGEST_FIELD, ChunkDigests
from pdserve_worker.transfer.hixl_api import MAX_NOTIFY_FIELD, status_name

log = logging.getLogger(__name__)

READY_NOTIFY = "kv_ready"
NOTIFY_TIMEOUT_MS = 2000  # one ready notify's send_notify timeout (retried while the queue is full)
_RESERVED_KEYS = ("request_id", "slot", "generation", "nonce", "num_tokens", DIGEST_FIELD)


class PushError(RuntimeError):
    """A put or notify to one target failed or timed out; the message names target and layers."""

    def __init__(self, message: str, target: Grant, layers: range | None = None, status: int | None = None):
        super().__init__(message)
        self.target = target
        self.layers = layers
        self.status = status


@dataclass(frozen=True)
class PushSource:
    """Where the prompt's KV lies in this process: a registered pool and the slot used, and the
    KV heads pushed from it (None: all it holds; a tensor-parallel rank holding a replica: none)."""

    base_addr: int
    layout: KVLayout
    slot: int = 0
    heads: range | None = None

    @property
    def pushed_heads(self) -> range:
        return self.layout.head_range if self.heads is None else self.heads


@dataclass
class PushStats:
    puts: int = 0
    requests: int = 0
    bytes: int = 0
    resource_exhausted: int = 0  # times the engine's queue was full
    depth_waits: int = 0  # times a target's queue depth made us reap first
    started: float = 0.0
    seconds: float = 0.0  # first put to last notify ACK


@dataclass
class _Put:
    req_id: int
    runs: int
    layers: range
    submitted: float


# One unit of a target's queue depth, in absolute addresses: one contiguous run (copies 1), or
# one (layer, K|V)'s head slices (strided runs, a descriptor per token). Expanded into the
# engine's descriptors only when submitted, so a push never holds 100,000 of them at once.
Run = list[Strided]


@dataclass
class _TargetState:
    target: Grant
    owned: range
    pieces: dict[tuple[int, int], list[Run]]  # (layer, K|V) -> its runs to the target
    pushed: set[int] = field(default_factory=set)
    outstanding: deque[_Put] = field(default_factory=deque)
    in_flight_runs: int = 0
    digest: ChunkDigests | None = None  # (transfer/digest.py; None where the backend declares none)

    def issued(self, layers: list[int]) -> None:
        """`layers`' puts are issued: hash what they put (while they are in flight)."""
        self.pushed.update(layers)
        if self.digest is not None:
            self.digest.add(layers, self.pieces)


# A head slice's descriptors per run and per transfer_async request: bounded, so a long
# prompt's slices never make one request the engine must refuse (the host engine's frames
# take 65,536 descriptors) and a request stays a few MB of 256-byte pieces.
MAX_RUN_DESCRIPTORS = 4096
MAX_REQUEST_DESCRIPTORS = 8192


def absolute_runs(runs: list[Strided], src_base: int, dst_base: int) -> list[Run]:
    """One (layer, K|V)'s copies, at the two pools' addresses, as units of the queue depth: each
    contiguous copy (merged over consecutive blocks) a Run of its own; head slices in Runs of at
    most MAX_RUN_DESCRIPTORS descriptors. (The prefill's push and a decode's migration alike.)"""
    moved = [Strided(src_base + a, dst_base + b, n, ss, ds, length) for a, b, n, ss, ds, length in coalesce(runs)]
    if all(r.copies == 1 for r in moved):
        return [[r] for r in moved]
    return split_runs(moved, MAX_RUN_DESCRIPTORS)


def split_runs(runs: list[Strided], limit: int) -> list[Run]:
    """Consecutive strided runs grouped into Runs of at most `limit` descriptors each; a
    strided run longer than that (a slot pool's "block" is a whole slot) is cut."""
    out: list[Run] = [[]]
    room = limit
    for r in runs:
        if r.copies <= room:  # (the usual case: a block's tokens)
            out[-1].append(r)
            room -= r.copies
            continue
        while r.copies:
            if not room:
                out.append([])
                room = limit
            take = min(r.copies, room)
            out[-1].append(r._replace(copies=take))
            r = r._replace(src=r.src + take * r.src_step, dst=r.dst + take * r.dst_step, copies=r.copies - take)
            room -= take
    return [run for run in out if run]


def _run_addrs(base_addr: int, layout: KVLayout, slot: int) -> dict[tuple[int, int], int]:
    """Start address of every (layer, K|V) run of a slot. The layout is slot, layer, K|V-major
    with a fixed stride, so one validated `offset` plus arithmetic gives them all (a validated
    call per run would cost more than the put itself for small prompts)."""
    first_layer, num_layers = layout.first_layer, layout.num_layers
    start = base_addr + layout.offset(slot, first_layer, K)
    stride = layout.bytes_per_kv_layer
    addrs = {}
    for i in range(num_layers):
        addrs[(first_layer + i, K)] = start + 2 * i * stride
        addrs[(first_layer + i, V)] = start + (2 * i + 1) * stride
    last = (first_layer + num_layers - 1, V)
    if addrs[last] != base_addr + layout.offset(slot, *last):
        raise RuntimeError("KVLayout is no longer fixed-stride: update push._run_addrs")
    return addrs


def layer_chunks(layers: range, per_chunk: int) -> list[range]:
    """Split `layers` into consecutive ranges of `per_chunk` (the last may be shorter)."""
    if per_chunk <= 0:
        raise ValueError(f"layers per chunk must be > 0, got {per_chunk}")
    return [range(s, min(s + per_chunk, layers.stop)) for s in range(layers.start, layers.stop, per_chunk)]


@dataclass(frozen=True)
class _Pieces:
    """The runs a push writes into a target, by the kind of its pool (see `KVPusher._target_pieces`)."""

    source: PushSource
    num_tokens: int
    src_addrs: dict[tuple[int, int], int]  # the source's (layer, K|V) runs; empty when paged
    run_len: int

    def row_pieces(self, target: Grant) -> dict[tuple[int, int], list[Run]]:
        """Whole rows into a slot: one contiguous run per (layer, K|V)."""
        dst_addrs = _run_addrs(target.base_addr, target.layout, target.slot)
        n = self.run_len
        return {run: [[Strided(self.src_addrs[run], addr, 1, 0, 0, n)]] for run, addr in dst_addrs.items()}

    def slot_slice_pieces(self, target: Grant) -> dict[tuple[int, int], list[Run]]:
        """A head slice into slots: each slot is one block of max_len tokens."""
        return self._pieces(target, target.layout.slot_blocks, (target.slot,), 0)

    def block_pieces(self, target: Grant) -> dict[tuple[int, int], list[Run]]:
        """A paged target's descriptors: the prompt's tokens into its own blocks (the shared
        ones already hold them), coalesced over runs of consecutive blocks."""
        blocks = target.layout.blocks
        bt = blocks.block_tokens
        if self.num_tokens > len(target.blocks) * bt:
            raise ValueError(
                f"target {target.describe()}: {self.num_tokens} tokens do not fit its "
                f"{len(target.blocks)} blocks of {bt}"
            )
        return self._pieces(target, blocks, target.blocks, min(target.shared * bt, self.num_tokens))

    def _pieces(
        self, target: Grant, view: BlockLayout, blocks: Sequence[int], start: int
    ) -> dict[tuple[int, int], list[Run]]:
        """Every (layer, K|V) of `view`'s layers: the runs of tokens start..num_tokens into
        `blocks` of `view`, for the heads source and target share (a tensor-parallel rank's
        share, or all). Whole rows: one run per run of consecutive blocks. A head slice: the
        (layer, K|V)'s strided runs as one run (a TP rank into a decode of another TP size:
        `_submit` makes their 2 × layers × tokens descriptors)."""
        src = self.source
        heads = shared_heads(src.pushed_heads, view.head_range)
        sb, tb = src.base_addr, target.base_addr
        route = PushRoute(src.layout, src.slot, view, blocks)
        pieces: dict[tuple[int, int], list[Run]] = {}
        for layer in view.layer_range:
            for kv_index in (K, V):
                runs = push_runs(route, layer, kv_index, self.num_tokens, start, heads)
                pieces[(layer, kv_index)] = absolute_runs(runs, sb, tb)
        return pieces


class KVPusher:
    """Pushes one prompt's KV into one or more decode targets. Use once per request."""

    def __init__(
        self,
        backend: TransferBackend,
        source: PushSource,
        targets: Iterable[Grant],
        num_tokens: int,
        *,
        queue_depth: int = 64,
        timeout_s: float = 10.0,
        connect_timeout_ms: int = 2000,
    ) -> None:
        if queue_depth <= 0:
            raise ValueError(f"queue_depth must be > 0, got {queue_depth}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self._backend = backend
        self._api = backend.api
        self.source = source
        self.num_tokens = num_tokens
        self.queue_depth = queue_depth
        self.timeout_s = timeout_s
        if not 0 <= source.slot < source.layout.num_slots:
            raise ValueError(f"source slot {source.slot} outside its pool of {source.layout.num_slots}")
        # A paged source (a decode's own pool, decode/migration.py) places tokens per block instead.
        src_addrs = {} if source.layout.paged else _run_addrs(source.base_addr, source.layout, source.slot)
        self._pieces = _Pieces(source, num_tokens, src_addrs, num_tokens * source.layout.bytes_per_token)
        self._states = [self._check_target(t) for t in targets]
        if not self._states:
            raise ValueError("a push needs at least one target")
        self.stats = PushStats()
        self._failed = False
        self._finished = False
        for state in self._states:
            try:
                backend.ensure_connected(state.target.engine_id, connect_timeout_ms)
            except TransferError as exc:
                raise PushError(
                    f"cannot reach target {state.target.describe()}: {exc}", state.target, status=exc.status
                ) from None

    def _check_target(self, target: Grant) -> _TargetState:
        src, dst = self.source.layout, target.layout
        # Without tensor parallelism both pools hold every head; a rank pushes its heads' share,
        # and a block pool (a tensor-parallel decode rank's) takes the heads it holds.
        exact = ("kv_heads", "first_head") if self.source.heads is None and not dst.paged else ()
        for attr in ("head_dim", "dtype", *exact):
            if getattr(src, attr) != getattr(dst, attr):
                raise ValueError(
                    f"target {target.describe()} has {attr}={getattr(dst, attr)!r}, source has {getattr(src, attr)!r}"
                )
        owned = self._owned_layers(target)
        for layout, who in ((src, "source"), (dst, f"target {target.describe()}")):
            if not 0 < self.num_tokens <= layout.max_len:
                raise ValueError(f"num_tokens={self.num_tokens} does not fit {who} max_len={layout.max_len}")
        if not 0 <= target.slot < dst.num_slots:
            raise ValueError(f"target {target.describe()}: slot outside its pool of {dst.num_slots}")
        digest = ChunkDigests.of(self._backend.digest, shared_heads(self.source.pushed_heads, dst.head_range))
        return _TargetState(target, owned, self._target_pieces(target), digest=digest)

    def _owned_layers(self, target: Grant) -> range:
        """The layers this push writes into `target`: all of them (a prefill holds every layer)."""
        src, dst = self.source.layout.layer_range, target.layout.layer_range
        if dst.start < src.start or dst.stop > src.stop:
            raise ValueError(f"target {target.describe()} holds layers {dst}, source only {src}")
        return dst

    def _target_pieces(self, target: Grant) -> dict[tuple[int, int], list[Run]]:
        """Every (layer, K|V) of the target's layers: its descriptors (source, target, bytes)."""
        if target.layout.paged:
            return self._pieces.block_pieces(target)
        if (
            self.source.pushed_heads != target.layout.head_range
            or self.source.layout.head_range != target.layout.head_range
        ):
            # A head slice into slots (a tensor-parallel prefill rank into a layer-sharded
            # decode member): each slot is one block of max_len tokens to push_descriptors.
            return self._pieces.slot_slice_pieces(target)
        return self._pieces.row_pieces(target)

    # ---- pushing -------------------------------------------------------------------------------------
    def push_chunk(self, layers: range) -> None:
        """Issue the puts of `layers` (just computed) to every target owning some of them."""
        if self._failed or self._finished:
            raise RuntimeError("push_chunk after the push failed or finished")
        if not self.stats.started:
            self.stats.started = time.perf_counter()
        bad = [layer for layer in layers if layer not in self.source.layout.layer_range]
        if bad:
            raise ValueError(f"layers {bad} are not in the source pool ({self.source.layout.layer_range})")
        try:
            for state in self._states:
                mine = [layer for layer in layers if layer in state.owned]
                if mine:
                    self._push_layers(state, mine)
                self._reap_all()  # keep completions flowing while other targets are fed
        except BaseException:
            self._fail()
            raise

    def _push_layers(self, state: _TargetState, layers: list[int]) -> None:
        runs = [(layer, piece) for layer in layers for kv_index in (K, V) for piece in state.pieces[(layer, kv_index)]]
        batch: list[tuple[int, Run]] = []
        descriptors = 0
        for layer, run in runs:
            n = sum(r.copies for r in run)
            if batch and (len(batch) == self.queue_depth or descriptors + n > MAX_REQUEST_DESCRIPTORS):
                self._wait_for_room(state, len(batch))
                self._submit(state, batch)
                batch, descriptors = [], 0
            batch.append((layer, run))
            descriptors += n
        if batch:
            self._wait_for_room(state, len(batch))
            self._submit(state, batch)
        state.issued(layers)

    def _submit(self, state: _TargetState, runs: list[tuple[int, Run]]) -> None:
        descs = _descriptors(self._api.TransferOpDesc, runs)
        layers = range(runs[0][0], runs[-1][0] + 1)
        deadline = time.monotonic() + self.timeout_s
        backoff = _Backoff()
        while True:
            status, req_id = self._backend.engine.transfer_async(
                state.target.engine_id, self._api.TransferOp.WRITE, descs
            )
            if status == self._api.SUCCESS:
                break
            if status != self._api.RESOURCE_EXHAUSTED:
                raise PushError(
                    f"put of layers {layers.start}..{layers.stop - 1} to {state.target.describe()} refused: "
                    f"{status_name(status)}",
                    state.target,
                    layers,
                    status,
                )
            # The engine's queue is full (ours or other pushers'): reap, back off, retry.
            self.stats.resource_exhausted += 1
            if time.monotonic() > deadline:
                raise PushError(
                    f"engine queue stayed full for {self.timeout_s}s while putting layers "
                    f"{layers.start}..{layers.stop - 1} to {state.target.describe()}",
                    state.target,
                    layers,
                    status,
                )
            self._reap_all()
            backoff.sleep()
        state.outstanding.append(_Put(req_id, len(runs), layers, time.monotonic()))
        state.in_flight_runs += len(runs)
        self.stats.puts += len(descs)
        self.stats.requests += 1
        self.stats.bytes += sum(d.len for d in descs)

    def _wait_for_room(self, state: _TargetState, runs: int) -> None:
        if state.in_flight_runs + runs <= self.queue_depth:
            return
        self.stats.depth_waits += 1
        self._wait(lambda: state.in_flight_runs + runs <= self.queue_depth)

    # ---- completions ---------------------------------------------------------------------------------
    def _reap_all(self) -> None:
        for state in self._states:
            self._reap(state)

    def _reap(self, state: _TargetState) -> None:
        """Collect finished puts of one target, oldest first, stopping at the first still
        waiting (that one is checked against the timeout). Raises on failure or timeout."""
        api = self._api
        waiting: deque[_Put] = deque()
        try:
            while state.outstanding:
                put = state.outstanding.popleft()
                status, transfer_status = self._backend.engine.get_transfer_status(put.req_id)
                if status == api.SUCCESS and transfer_status == api.TransferStatus.COMPLETED:
                    state.in_flight_runs -= put.runs
                    continue
                if status == api.SUCCESS and transfer_status == api.TransferStatus.WAITING:
                    waiting.append(put)
                    if time.monotonic() - put.submitted > self.timeout_s:
                        self._timeout(state, put)
                    break
                state.in_flight_runs -= put.runs
                raise PushError(
                    f"put of layers {put.layers.start}..{put.layers.stop - 1} to {state.target.describe()} failed: "
                    f"status={status_name(status)} transfer={getattr(transfer_status, 'name', transfer_status)}",
                    state.target,
                    put.layers,
                    status,
                )
        finally:
            waiting.extend(state.outstanding)
            state.outstanding = waiting

    def _timeout(self, state: _TargetState, put: _Put) -> None:
        # HIXL has no async timeout of its own; the docs say disconnect to clean up.
        self._backend.engine.disconnect(state.target.engine_id, 1000)
        raise PushError(
            f"put of layers {put.layers.start}..{put.layers.stop - 1} to {state.target.describe()} "
            f"timed out after {self.timeout_s}s (target disconnected)",
            state.target,
            put.layers,
            self._api.TIMEOUT,
        )

    def _wait(self, done: Callable[[], bool]) -> None:
        """Reap until `done()`. Timeouts are per put (in _reap), so this cannot wait forever.

        Between reaps: sleep until the oldest outstanding put completes where the engine can
        block on a transfer (the host engine's `wait_transfer`), else poll with backoff (HIXL
        has no blocking wait for a transfer)."""
        backoff = _Backoff()
        waiter = self._backend.blocking
        while True:
            self._reap_all()
            if done():
                return
            oldest = min(
                (s.outstanding[0] for s in self._states if s.outstanding), key=lambda p: p.submitted, default=None
            )
            if waiter is not None and oldest is not None:
                left = self.timeout_s - (time.monotonic() - oldest.submitted)
                waiter.wait_transfer(oldest.req_id, min(max(left, 0.0) + 0.001, 0.05))
            else:
                backoff.sleep()

    def flush(self) -> None:
        """Wait until every put issued so far has completed (raises PushError like push_chunk)."""
        if self._failed or self._finished:
            raise RuntimeError("flush after the push failed or finished")
        try:
            self._wait(lambda: all(not s.outstanding for s in self._states))
        except BaseException:
            self._fail()
            raise

    # ---- the end -------------------------------------------------------------------------------------
    def finish(self, extra: dict[str, object] | None = None) -> PushStats:
        """Wait for every put, then notify each target that its slot is ready."""
        if self._failed or self._finished:
            raise RuntimeError("finish after the push failed or finished")
        extra = dict(extra or {})
        clash = [k for k in _RESERVED_KEYS if k in extra]
        if clash:
            raise ValueError(f"extra must not set {clash}: the pusher fills them")
        return self._end(extra)

    def settle(self) -> PushStats:
        """Wait for every put and notify nobody: a tensor-parallel rank's share of a push, whose
        ready notify rank 0 sends once every rank's puts landed (ranks/prefill.py)."""
        if self._failed or self._finished:
            raise RuntimeError("settle after the push failed or finished")
        return self._end(None)

    def _end(self, extra: dict[str, object] | None) -> PushStats:
        for state in self._states:
            missing = sorted(set(state.owned) - state.pushed)
            if missing:
                self._fail()
                raise PushError(
                    f"finish before layers {missing[0]}..{missing[-1]} were pushed to {state.target.describe()}",
                    state.target,
                    range(missing[0], missing[-1] + 1),
                )
        try:
            self._wait(lambda: all(not s.outstanding for s in self._states))
            if extra is not None:
                for state in self._states:
                    _send_ready(self._backend, state, self.num_tokens, extra, self.timeout_s)
        except BaseException:
            self._fail()
            raise
        self._finished = True
        self.stats.seconds = time.perf_counter() - (self.stats.started or time.perf_counter())
        log.debug(
            kv(
                event="kv_pushed",
                targets=len(self._states),
                puts=self.stats.puts,
                bytes=self.stats.bytes,
                seconds=f"{self.stats.seconds:.6f}",
            )
        )
        return self.stats

    def abort(self) -> None:
        """Give up (e.g. the compute failed): reap what is in flight, notify nobody.

        The decode side's lease then expires and quarantines the slot."""
        self._fail()

    def _fail(self) -> None:
        """Forget outstanding puts, querying each until terminal (bounded) so the engine's
        un-queried count does not leak."""
        if self._failed:
            return
        self._failed = True
        _forget(self._backend, self._states, min(self.timeout_s, 5.0))


class _Backoff:
    """Between polls: yield the GIL for the first 100 µs (small copies finish that fast), then
    sleep about 50 µs per poll up to 5 ms, then 1 ms: short waits stay short, long ones cost
    little CPU. (HIXL offers no blocking wait for a transfer, so the pusher polls.)"""

    def __init__(self) -> None:
        self._start = time.perf_counter()

    def sleep(self) -> None:
        waited = time.perf_counter() - self._start
        if waited < 0.0001:
            time.sleep(0)
        elif waited < 0.005:
            time.sleep(0.00005)
        else:
            time.sleep(0.001)


def _descriptors(make: Callable[[int, int, int], Any], runs: list[tuple[int, Run]]) -> list[Any]:
    """The engine's descriptors of `runs`: one per contiguous run, one per token of a head slice."""
    descs = []
    for _, run in runs:
        for r in run:
            if r.copies == 1:
                descs.append(make(r.src, r.dst, r.length))
            else:  # a C-level map: a head slice makes one descriptor per token
                srcs = range(r.src, r.src + r.copies * r.src_step, r.src_step)
                dsts = range(r.dst, r.dst + r.copies * r.dst_step, r.dst_step)
                descs.extend(map(make, srcs, dsts, repeat(r.length, r.copies)))
    return descs


def _forget(backend: TransferBackend, states: list[_TargetState], within_s: float) -> None:
    """Query each outstanding put until terminal (for at most `within_s`), then drop them all."""
    api = backend.api
    deadline = time.monotonic() + within_s
    backoff = _Backoff()
    for state in states:
        while state.outstanding and time.monotonic() < deadline:
            put = state.outstanding[0]
            status, ts = backend.engine.get_transfer_status(put.req_id)
            if status == api.SUCCESS and ts == api.TransferStatus.WAITING:
                backoff.sleep()
                continue
            state.outstanding.popleft()
        state.outstanding.clear()
        state.in_flight_runs = 0


def _send_ready(
    backend: TransferBackend, state: _TargetState, num_tokens: int, extra: dict[str, object], timeout_s: float
) -> None:
    """Tell the target its KV is in place: one `kv_ready` notify (with the chunks' digests),
    retried while its queue is full."""
    t = state.target
    fields = {
        "request_id": t.request_id,
        "slot": t.slot,
        "generation": t.generation,
        "nonce": t.nonce,
        "num_tokens": num_tokens,
        **extra,
    }
    if state.digest is not None:
        fields[DIGEST_FIELD] = state.digest.field()
    message = json.dumps(fields, separators=(",", ":"))
    if len(message) > MAX_NOTIFY_FIELD and state.digest is not None:  # the last digest covers every chunk
        fields[DIGEST_FIELD] = state.digest.field(compact=True)
        message = json.dumps(fields, separators=(",", ":"))
    if len(message) > MAX_NOTIFY_FIELD:
        raise ValueError(f"ready message for {t.describe()} is {len(message)} chars, over HIXL's 1024")
    desc = backend.api.NotifyDesc(READY_NOTIFY, message)
    deadline = time.monotonic() + timeout_s
    backoff = _Backoff()
    while True:
        status = backend.engine.send_notify(t.engine_id, desc, NOTIFY_TIMEOUT_MS)
        if status == backend.api.SUCCESS:
            return
        if status != backend.api.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
            raise PushError(f"ready notify to {t.describe()} failed: {status_name(status)}", t, status=status)
        backoff.sleep()  # the decode's notify queue is full: it drains, we retry


def prefill_and_push(
    compute: Callable[[range], None],
    pusher: KVPusher,
    chunks: Iterable[range],
    extra: dict[str, object] | None = None,
    pipelined: bool = True,
) -> PushStats:
    """Run `compute(chunk)` for each layer chunk and push its KV.

    pipelined: push each chunk right after computing it (transfer overlaps the next chunk's
    compute). Not pipelined: compute everything, then push (the baseline the overlap is
    measured against).
    """
    chunks = list(chunks)
    try:
        for chunk in chunks:
            compute(chunk)
            if pipelined:
                pusher.push_chunk(chunk)
        if not pipelined:
            for chunk in chunks:
                pusher.push_chunk(chunk)
        return pusher.finish(extra)
    except BaseException:
        pusher.abort()
        raise
