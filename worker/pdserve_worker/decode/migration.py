"""Live migration, the decode's side: hand running requests over to another decode when draining.

A draining decode parks every running request (`Generator.detach`): its KV stays, and a
`Handoff` records the tokens so far and the sampler's seed. The stream sends a `handover`
event; the router reserves on another decode and calls `Migrate` here, which pushes the KV of
every token but the last streamed one (`MigrationPusher`) and notifies the target, which
replays the streamed tokens (`Generator.add_prefilled`).

One release path: `Handoff.release` frees the KV exactly once, whichever comes first (the
Migrate, a cancelled stream, the wait running out, the worker closing), and never while a
push reads it. Layer-sharded groups and tensor-parallel decodes migrate as one, each member or
rank pushing what it holds (`migration_runs` cuts rows where head splits differ).
The full account: docs/roles.md.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve_common.kv_layout import DTYPE_SIZES, HeadSlice, K, KVLayout, Strided, V, coalesce, shared_heads
from pdserve_common.logs import kv
from pdserve_worker.kv.slots import Grant
from pdserve_worker.model.engine import Detached
from pdserve_worker.transfer.base import TransferBackend
from pdserve_worker.transfer.push import KVPusher, PushSource, PushStats, Run, absolute_runs, layer_chunks

log = logging.getLogger(__name__)

MIGRATED = "migrated"  # the key a migration's ready notify carries (with "seed" and "num_generated")


class HandoffUnavailable(RuntimeError):
    """No request handed over here under that (slot, generation), or its Migrate already ran."""


class Handoff:
    """One parked request and the one way its KV is freed (thread-safe)."""

    PARKED, MIGRATING, RELEASED = "parked", "migrating", "released"

    def __init__(self, detached: Detached, on_done: Callable[[], None]) -> None:
        self.detached = detached
        self.generation = -1  # set when its Generate files it (`HandoffBook.add`)
        self.parked_at = time.monotonic()
        self._on_done = on_done
        self._lock = threading.Lock()
        self._state = self.PARKED
        self._release_pending = False
        self.outcome: str | None = None  # "migrated" / "failed" / "released" (never migrated)

    @property
    def slot(self) -> int:
        return self.detached.slot

    @property
    def state(self) -> str:
        with self._lock:
            return self._state

    @property
    def settled(self) -> bool:
        """Nothing more will happen to it: migrated, failed or released."""
        return self.state == self.RELEASED

    def take(self) -> bool:
        """Claim it for a Migrate (once): False if it was released or is being migrated."""
        with self._lock:
            if self._state != self.PARKED:
                return False
            self._state = self.MIGRATING
            return True

    def finish(self, migrated: bool) -> None:
        """The Migrate is over (pushed and notified, or failed): the KV is nobody's now."""
        with self._lock:
            if self._state != self.MIGRATING:
                return
            self._state = self.RELEASED
            self.outcome = "migrated" if migrated else "failed"
        self._free()

    def release(self) -> None:
        """Give the KV back (cancelled stream, nobody migrated it, shutdown): at once, or once a
        Migrate reading it is over."""
        with self._lock:
            if self._state == self.MIGRATING:
                self._release_pending = True
                return
            if self._state == self.RELEASED:
                return
            self._state = self.RELEASED
            self.outcome = "released"
        self._free()

    def _free(self) -> None:
        try:
            self._on_done()
        except Exception:
            log.exception(kv(event="handoff_release_failed", slot=self.slot, generation=self.generation))


class HandoffBook:
    """The requests parked on this decode, by (slot, generation) (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handoffs: dict[tuple[int, int], Handoff] = {}

    def add(self, handoff: Handoff, generation: int) -> None:
        with self._lock:
            self._prune()
            handoff.generation = generation
            self._handoffs[(handoff.slot, generation)] = handoff

    def get(self, slot: int, generation: int) -> Handoff | None:
        with self._lock:
            return self._handoffs.get((slot, generation))

    def take(self, request_id: str, slot: int, generation: int) -> Handoff:
        """The handoff a Migrate may push from, claimed (raises HandoffUnavailable)."""
        handoff = self.get(slot, generation)
        if handoff is None or handoff.detached.request_id.rsplit("#", 1)[0] != request_id or not handoff.take():
            raise HandoffUnavailable(
                f"no request {request_id!r} handed over in slot {slot} generation "
                f"{generation} (never parked, released, or already migrated)"
            )
        return handoff

    def pending(self) -> int:
        with self._lock:
            self._prune()
            return len(self._handoffs)

    def release_all(self) -> None:
        with self._lock:
            handoffs = list(self._handoffs.values())
            self._handoffs.clear()
        for handoff in handoffs:
            handoff.release()

    def _prune(self) -> None:
        for key in [k for k, h in self._handoffs.items() if h.settled]:
            del self._handoffs[key]


# ---- where the bytes go (pure) ------------------------------------------------------------------

Extent = tuple[int, int, int]  # (first token, end token, byte offset of the first token from the pool base)


@dataclass(frozen=True)
class PoolPlace:
    """Where a request's KV lives in a decode pool: slot `slot` of a slot pool, or `blocks` (in
    token order) of a paged one."""

    layout: KVLayout
    slot: int
    blocks: Sequence[int] = ()


def token_extents(place: PoolPlace, layer: int, kv_index: int) -> list[Extent]:
    """Where tokens of (layer, K|V) of a request live in a pool: one extent for a slot pool,
    one per block (in token order) for a paged pool."""
    layout, slot, blocks = place.layout, place.slot, place.blocks
    if layout.paged:
        geometry, bt = layout.blocks, layout.block_tokens
        return [(i * bt, (i + 1) * bt, geometry.offset(layer, kv_index, b)) for i, b in enumerate(blocks)]
    return [(0, layout.max_len, layout.offset(slot, layer, kv_index))]


def migration_runs(
    source: PoolPlace, target: PoolPlace, layer: int, kv_index: int, start: int, end: int
) -> list[Strided]:
    """Copies of tokens [start, end) of (layer, K|V) from one decode pool to another, either slot
    or paged, for the KV heads both hold: one run per stretch contiguous on both sides
    (coalesced) when both hold the same heads; else, per stretch, a slice of each token's row (a
    tensor-parallel rank's heads into a decode split otherwise, or the reverse)."""
    src, dst = source.layout, target.layout
    if not 0 <= start <= end:
        raise ValueError(f"token range {start}..{end} is reversed or negative")
    if (src.head_dim, src.dtype) != (dst.head_dim, dst.dtype):
        raise ValueError(f"bytes per token differ: source {src.bytes_per_token}, target {dst.bytes_per_token}")
    heads = shared_heads(src.head_range, dst.head_range)
    sources = token_extents(source, layer, kv_index)
    targets = token_extents(target, layer, kv_index)
    for extents, who in ((sources, "source"), (targets, "target")):
        if end > (extents[-1][1] if extents else 0):
            raise ValueError(f"{end} tokens do not fit the {who}'s {extents[-1][1] if extents else 0}")
    if not heads:
        return []
    src_row, dst_row = src.bytes_per_token, dst.bytes_per_token
    cut = HeadSlice.of(heads, src.first_head, src_row, dst.first_head, dst_row, src.head_dim * DTYPE_SIZES[src.dtype])
    return coalesce(cut.run(s, d, n) for s, d, n in _stretches(sources, targets, src_row, dst_row, start, end))


def _stretches(
    sources: list[Extent], targets: list[Extent], src_row: int, dst_row: int, start: int, end: int
) -> list[tuple[int, int, int]]:
    """(source offset, target offset, tokens) of each stretch of tokens contiguous on both sides."""
    out = []
    t, i, j = start, 0, 0
    while t < end:
        while sources[i][1] <= t:
            i += 1
        while targets[j][1] <= t:
            j += 1
        (s0, s1, s_off), (d0, d1, d_off) = sources[i], targets[j]
        stop = min(s1, d1, end)
        out.append((s_off + (t - s0) * src_row, d_off + (t - d0) * dst_row, stop - t))
        t = stop
    return out


def common_layers(a: range, b: range) -> range:
    """The layers two pools both hold (empty when they hold none in common)."""
    start = max(a.start, b.start)
    return range(start, max(start, min(a.stop, b.stop)))


class MigrationPusher(KVPusher):
    """`KVPusher` from a decode's own pool (slot or paged) instead of a prefill's scratch slot:
    the same engine, queue depth, layer chunks, timeouts and nonce-carrying notify. A member of
    a layer-sharded group holds some layers only: it writes into each target the layers both
    hold (none, for a target that holds none of its layers: that one gets only the notify, if
    this pusher sends it)."""

    def __init__(
        self,
        backend: TransferBackend,
        source: PushSource,
        source_blocks: Sequence[int],
        targets: Sequence[Grant],
        num_tokens: int,
        **kwargs: object,
    ) -> None:
        self._source_blocks = tuple(source_blocks)
        super().__init__(backend, source, targets, num_tokens, **kwargs)  # type: ignore[arg-type]

    def _owned_layers(self, target: Grant) -> range:
        return common_layers(self.source.layout.layer_range, target.layout.layer_range)

    def _target_pieces(self, target: Grant) -> dict[tuple[int, int], list[Run]]:
        dst = target.layout
        start = min(target.shared * dst.block_tokens, self.num_tokens) if dst.paged else 0
        source = PoolPlace(self.source.layout, self.source.slot, self._source_blocks)
        place = PoolPlace(dst, target.slot, target.blocks)
        pieces: dict[tuple[int, int], list[Run]] = {}
        for layer in self._owned_layers(target):
            for kv_index in (K, V):
                runs = migration_runs(source, place, layer, kv_index, start, self.num_tokens)
                pieces[(layer, kv_index)] = absolute_runs(runs, self.source.base_addr, target.base_addr)
        return pieces


@dataclass(frozen=True)
class PushPace:
    """How a hand-over's push runs: layers per chunk, and how long its puts may take."""

    layers_per_chunk: int
    timeout_s: float


@dataclass(frozen=True)
class MigrationResult:
    num_tokens: int
    stats: PushStats


def push_handoff(
    backend: TransferBackend,
    source: PushSource,
    source_blocks: Sequence[int],
    handoff: Handoff,
    targets: Sequence[Grant],
    pace: PushPace,
    before_notify: Callable[[], int] | None = None,
) -> MigrationResult:
    """Push a parked request's KV into `targets` chunk of layers by chunk, then notify them with
    the generation state (blocking: run it off the event loop). Raises PushError / ValueError.
    `before_notify`: a layer-sharded group's other members pushed their layers too; it waits
    for them (returning their bytes) before the notify, which tells the targets all is there."""
    d = handoff.detached
    num_tokens = d.kv_tokens
    pusher = MigrationPusher(backend, source, source_blocks, targets, num_tokens, timeout_s=pace.timeout_s)
    try:
        for chunk in layer_chunks(source.layout.layer_range, max(1, pace.layers_per_chunk)):
            pusher.push_chunk(chunk)
        pusher.stats.bytes += before_notify() if before_notify is not None else 0
        stats = pusher.finish(
            {"first_token": d.output_ids[-1], MIGRATED: 1, "seed": d.seed, "num_generated": len(d.output_ids)}
        )
    except BaseException:
        pusher.abort()
        raise
    return MigrationResult(num_tokens, stats)
