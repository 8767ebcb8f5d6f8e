"""Where each byte of KV lives in a decode pool: pure arithmetic, shared by every role.

A slot pool is slot-major, then layer, then K/V, then token-major `[max_len, kv_heads, head_dim]`
(DESIGN.md): a prompt's first n tokens of one (slot, layer, K|V) are one contiguous run, so a
prefill pushes one descriptor per layer and K/V, not one per token. A *paged* pool
(`block_tokens` > 0, `BlockLayout`) is layer-major `(layer, K|V, block, token-in-block, kv_head,
head_dim)`: a run of consecutive blocks of one (layer, K|V) is one contiguous range on both sides
(the source slot is token-major per layer), so a reservation in consecutive blocks costs a slot's
descriptors and a fragmented one a descriptor per run; it is also the per-layer
`[num_blocks, block_size, kv_heads, head_dim]` cache paged attention reads. A paged layout has no
slot runs. A pool may hold a layer range (`first_layer`, `num_layers`: a layer-sharded member) and
a KV head range (`first_head`, `kv_heads`: a tensor-parallel rank); a layer outside is an error,
never a wrong offset. A push between different head ranges moves the heads both hold: whole rows
as runs, else a slice of each token's row, one copy per token (`push_descriptors`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from itertools import repeat
from typing import NamedTuple

from pdserve.v1 import common_pb2

DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
}

K, V = 0, 1


def local_layer_index(layer_range: range, layer: int) -> int:
    """Index into a pool holding model layers `layer_range` of model layer `layer`.

    One place for the slot pool (kv/cache.py) and the block pool (kv/paged.py).
    """
    if layer not in layer_range:
        raise IndexError(f"layer {layer} not held by this KV pool (holds {layer_range.start}..{layer_range.stop - 1})")
    return layer - layer_range.start


@dataclass(frozen=True)
class KVLayout:
    """Geometry of one registered KV pool."""

    num_slots: int
    num_layers: int
    max_len: int
    kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    first_layer: int = 0
    block_tokens: int = 0  # > 0: a paged pool of `num_blocks` blocks (BlockLayout below)
    num_blocks: int = 0
    first_head: int = 0  # the pool holds KV heads first_head.. first_head + kv_heads - 1

    def __post_init__(self) -> None:
        for name in ("num_slots", "num_layers", "max_len", "kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        for name in ("first_layer", "first_head"):
            if getattr(self, name) < 0:
                raise ValueError(f"KVLayout.{name} must be >= 0, got {getattr(self, name)!r}")
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"KVLayout.dtype must be one of {sorted(DTYPE_SIZES)}, got {self.dtype!r}")
        if self.block_tokens < 0 or self.num_blocks < 0 or (self.block_tokens > 0) != (self.num_blocks > 0):
            raise ValueError(
                f"KVLayout.block_tokens and num_blocks must both be positive (paged) or both 0, got "
                f"{self.block_tokens!r} and {self.num_blocks!r}"
            )

    @property
    def paged(self) -> bool:
        return self.block_tokens > 0

    @property
    def blocks(self) -> BlockLayout:
        """The block geometry of a paged pool."""
        if not self.paged:
            raise ValueError("a slot pool has no blocks")
        return BlockLayout(
            self.num_blocks,
            self.block_tokens,
            self.num_layers,
            self.kv_heads,
            self.head_dim,
            self.dtype,
            self.first_layer,
            self.first_head,
        )

    @property
    def head_range(self) -> range:
        """The KV heads this pool holds."""
        return range(self.first_head, self.first_head + self.kv_heads)

    @property
    def kv_tokens(self) -> int:
        """Tokens of KV the pool holds (all requests together)."""
        return self.num_blocks * self.block_tokens if self.paged else self.num_slots * self.max_len

    def _slot_pool(self, what: str) -> None:
        if self.paged:
            raise ValueError(f"{what} of a paged KV pool: its requests' KV is where their block tables say")

    @property
    def dtype_size(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def layer_range(self) -> range:
        """The model layers this pool holds."""
        return range(self.first_layer, self.first_layer + self.num_layers)

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        """The pool as a contiguous tensor: (slot, layer, K|V, token, kv_head, head_dim), or a
        paged pool's (layer, K|V, block, token, kv_head, head_dim)."""
        if self.paged:
            return self.blocks.shape
        return (self.num_slots, self.num_layers, 2, self.max_len, self.kv_heads, self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token's K (or V) in one layer."""
        return self.kv_heads * self.head_dim * self.dtype_size

    @property
    def bytes_per_kv_layer(self) -> int:
        self._slot_pool("bytes_per_kv_layer")
        return self.max_len * self.bytes_per_token

    @property
    def bytes_per_slot(self) -> int:
        self._slot_pool("bytes_per_slot")
        return self.num_layers * 2 * self.bytes_per_kv_layer

    @property
    def total_bytes(self) -> int:
        if self.paged:
            return self.blocks.total_bytes
        return self.num_slots * self.bytes_per_slot

    def offset(self, slot: int, layer: int, kv: int) -> int:
        """Byte offset of (slot, layer, K|V) from the pool's base; `layer` is the model's index."""
        self._slot_pool("offset")
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} outside pool of {self.num_slots} slots")
        if layer not in self.layer_range:
            raise IndexError(
                f"layer {layer} not held by this pool (holds {self.first_layer}..{self.layer_range.stop - 1})"
            )
        if kv not in (K, V):
            raise IndexError(f"kv must be 0 (K) or 1 (V), got {kv}")
        local = layer - self.first_layer
        return ((slot * self.num_layers + local) * 2 + kv) * self.bytes_per_kv_layer

    def token_run(self, slot: int, layer: int, kv: int, num_tokens: int, start_token: int = 0) -> tuple[int, int]:
        """(offset, length) of tokens [start_token, start_token+num_tokens) of one (slot, layer, K|V)."""
        if num_tokens < 0 or start_token < 0 or start_token + num_tokens > self.max_len:
            raise IndexError(f"tokens {start_token}..{start_token + num_tokens} outside max_len {self.max_len}")
        return (
            self.offset(slot, layer, kv) + start_token * self.bytes_per_token,
            num_tokens * self.bytes_per_token,
        )

    @property
    def slot_blocks(self) -> SlotBlocks:
        """A slot pool as `push_descriptors` cuts it: each slot one block of max_len tokens."""
        self._slot_pool("slot_blocks")
        return SlotBlocks(
            self.num_slots,
            self.max_len,
            self.num_layers,
            self.kv_heads,
            self.head_dim,
            self.dtype,
            self.first_layer,
            self.first_head,
        )

    def slot_span(self, slot: int) -> tuple[int, int]:
        """(offset, length) of a whole slot: what a warmup touches and a release may clear."""
        return self.offset(slot, self.first_layer, K), self.bytes_per_slot

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> KVLayout:
        return cls(**data)  # type: ignore[arg-type]


def shard_layers(num_layers: int, shards: int) -> list[range]:
    """Balanced contiguous layer ranges for a decode group of `shards` members.

    The first `num_layers % shards` members get one extra layer, so sizes differ by at most one.
    """
    if shards <= 0 or shards > num_layers:
        raise ValueError(f"shards must be in 1..{num_layers}, got {shards}")
    base, extra = divmod(num_layers, shards)
    ranges, start = [], 0
    for i in range(shards):
        size = base + (1 if i < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


def layout_to_proto(layout: KVLayout) -> common_pb2.KVLayout:
    return common_pb2.KVLayout(
        num_slots=layout.num_slots,
        num_layers=layout.num_layers,
        max_len=layout.max_len,
        kv_heads=layout.kv_heads,
        head_dim=layout.head_dim,
        dtype=layout.dtype,
        first_layer=layout.first_layer,
        block_tokens=layout.block_tokens,
        num_blocks=layout.num_blocks,
        first_head=layout.first_head,
    )


def layout_from_proto(msg: common_pb2.KVLayout) -> KVLayout:
    """The layout a peer sent; ValueError names the field when it is not a valid pool geometry."""
    return KVLayout(
        num_slots=msg.num_slots,
        num_layers=msg.num_layers,
        max_len=msg.max_len,
        kv_heads=msg.kv_heads,
        head_dim=msg.head_dim,
        dtype=msg.dtype,
        first_layer=msg.first_layer,
        block_tokens=msg.block_tokens,
        num_blocks=msg.num_blocks,
        first_head=msg.first_head,
    )


# --- paged pools ------------------------------------------------------------------------
@dataclass(frozen=True)
class BlockLayout:
    """Geometry of one registered block pool."""

    num_blocks: int
    block_tokens: int
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    first_layer: int = 0
    first_head: int = 0  # the pool holds KV heads first_head.. first_head + kv_heads - 1

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_tokens", "num_layers", "kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"BlockLayout.{name} must be a positive int, got {value!r}")
        for name in ("first_layer", "first_head"):
            if getattr(self, name) < 0:
                raise ValueError(f"BlockLayout.{name} must be >= 0, got {getattr(self, name)!r}")
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"BlockLayout.dtype must be one of {sorted(DTYPE_SIZES)}, got {self.dtype!r}")

    @property
    def dtype_size(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def layer_range(self) -> range:
        return range(self.first_layer, self.first_layer + self.num_layers)

    @property
    def head_range(self) -> range:
        return range(self.first_head, self.first_head + self.kv_heads)

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        """The pool as a contiguous tensor: (layer, K|V, block, token, kv_head, head_dim)."""
        return (self.num_layers, 2, self.num_blocks, self.block_tokens, self.kv_heads, self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token's K (or V) in one layer."""
        return self.kv_heads * self.head_dim * self.dtype_size

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block of one (layer, K|V)."""
        return self.block_tokens * self.bytes_per_token

    @property
    def total_tokens(self) -> int:
        return self.num_blocks * self.block_tokens

    @property
    def total_bytes(self) -> int:
        return self.num_layers * 2 * self.num_blocks * self.bytes_per_block

    def offset(self, layer: int, kv: int, block: int) -> int:
        """Byte offset of block `block` of (layer, K|V) from the pool's base; `layer` is the model's."""
        if layer not in self.layer_range:
            raise IndexError(
                f"layer {layer} not held by this pool (holds {self.first_layer}..{self.layer_range.stop - 1})"
            )
        if kv not in (K, V):
            raise IndexError(f"kv must be 0 (K) or 1 (V), got {kv}")
        if not 0 <= block < self.num_blocks:
            raise IndexError(f"block {block} outside pool of {self.num_blocks} blocks")
        return (((layer - self.first_layer) * 2 + kv) * self.num_blocks + block) * self.bytes_per_block

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> BlockLayout:
        return cls(**data)  # type: ignore[arg-type]

    def for_budget(self, kv_tokens: int) -> BlockLayout:
        """This pool's geometry holding `kv_tokens` tokens (rounded down to whole blocks)."""
        if kv_tokens < self.block_tokens:
            raise ValueError(f"kv_tokens ({kv_tokens}) must hold at least one block of {self.block_tokens} tokens")
        return replace(self, num_blocks=kv_tokens // self.block_tokens)


@dataclass(frozen=True)
class Run:
    """`count` consecutive pool blocks starting at `block`, holding list positions `index`.. ."""

    index: int
    block: int
    count: int


def block_runs(blocks: Sequence[int]) -> list[Run]:
    """Maximal runs of consecutive block ids in a block list (in list order)."""
    runs: list[Run] = []
    for i, b in enumerate(blocks):
        if runs and runs[-1].block + runs[-1].count == b:
            last = runs[-1]
            runs[-1] = Run(last.index, last.block, last.count + 1)
        else:
            runs.append(Run(i, b, 1))
    return runs


@dataclass(frozen=True)
class SlotBlocks(BlockLayout):
    """A slot pool seen as a block pool whose blocks are its slots (block_tokens = max_len), so
    that `push_descriptors` can cut a head slice into it (a tensor-parallel prefill rank into a
    layer-sharded decode member's slots). Only the order of the pieces differs: a slot pool
    keeps one slot's layers together ([slot][layer][K|V][token], `KVLayout.offset`), a block
    pool one layer's blocks."""

    def offset(self, layer: int, kv: int, block: int) -> int:
        if layer not in self.layer_range:
            raise IndexError(
                f"layer {layer} not held by this pool (holds {self.first_layer}..{self.layer_range.stop - 1})"
            )
        if kv not in (K, V):
            raise IndexError(f"kv must be 0 (K) or 1 (V), got {kv}")
        if not 0 <= block < self.num_blocks:
            raise IndexError(f"slot {block} outside pool of {self.num_blocks} slots")
        return ((block * self.num_layers + layer - self.first_layer) * 2 + kv) * self.bytes_per_block


class Descriptor(NamedTuple):
    """One contiguous copy: `length` bytes from `src` (source offset) to `dst` (pool offset).

    A NamedTuple, not a frozen dataclass: a head-sliced push makes one per token per layer,
    and a frozen dataclass costs ~5× a tuple to build."""

    src: int
    dst: int
    length: int


def check_compatible(source: KVLayout, dest: BlockLayout) -> None:
    """A source slot and a block pool hold KV of one geometry (else the bytes would be garbage)."""
    mine = (source.head_dim, source.dtype)
    theirs = (dest.head_dim, dest.dtype)
    if mine != theirs:
        raise ValueError(f"KV geometry differs: source (head_dim, dtype)={mine}, block pool {theirs}")


def shared_heads(source: range, dest: range) -> range:
    """The KV heads two pools both hold (empty when none)."""
    start, stop = max(source.start, dest.start), min(source.stop, dest.stop)
    return range(start, max(start, stop))


class Strided(NamedTuple):
    """`copies` copies of `length` bytes: the i-th from `src + i * src_step` to `dst + i * dst_step`.

    A head slice of a block's tokens is one of these (a token's heads are a slice of its row on
    either side): kept whole, a TP rank's push to a decode of another TP size is 7,680 of them
    for 2048 tokens of 30 layers instead of 122,880 descriptors built one by one, and the
    pusher expands each into the engine's descriptors in one C-level `map`."""

    src: int
    dst: int
    copies: int
    src_step: int
    dst_step: int
    length: int

    def descriptors(self) -> list[Descriptor]:
        if self.copies == 1:
            return [Descriptor(self.src, self.dst, self.length)]
        return list(
            map(
                Descriptor,
                range(self.src, self.src + self.copies * self.src_step, self.src_step),
                range(self.dst, self.dst + self.copies * self.dst_step, self.dst_step),
                repeat(self.length, self.copies),
            )
        )


def coalesce(runs: Iterable[Strided]) -> list[Strided]:
    """Runs with empty ones dropped and contiguous copies (copies 1) merged where they continue
    one another on both sides, so the merge is always exact. Head slices never continue one
    another (one side's rows are wider than the slice): they stay as they are."""
    out: list[Strided] = []
    for r in runs:
        if r.copies == 0 or r.length == 0:
            continue
        last = out[-1] if out else None
        if (
            last
            and last.copies == r.copies == 1
            and last.src + last.length == r.src
            and last.dst + last.length == r.dst
        ):
            out[-1] = Strided(last.src, last.dst, 1, 0, 0, last.length + r.length)  # (not _replace: 3x the cost)
        else:
            out.append(r)
    return out


class HeadSlice(NamedTuple):
    """Where KV heads sit in a token's row on a source and a target, and the copy that moves
    them for a stretch of tokens: the one rule of the prefill's push and a decode's migration."""

    src_skip: int  # bytes before the heads in a source row
    dst_skip: int
    span: int  # the heads' bytes in a row
    src_row: int
    dst_row: int

    @classmethod
    def of(
        cls, heads: range, src_first_head: int, src_row: int, dst_first_head: int, dst_row: int, head_bytes: int
    ) -> HeadSlice:
        skips = ((heads.start - src_first_head) * head_bytes, (heads.start - dst_first_head) * head_bytes)
        return cls(*skips, len(heads) * head_bytes, src_row, dst_row)

    def run(self, src: int, dst: int, tokens: int) -> Strided:
        """The copy of `tokens` rows starting at `src` and `dst` (offsets of the rows): one
        contiguous copy where the heads are the whole row on both sides, else a slice per token."""
        if self.span == self.src_row == self.dst_row:
            return Strided(src, dst, 1, 0, 0, tokens * self.span)
        return Strided(src + self.src_skip, dst + self.dst_skip, tokens, self.src_row, self.dst_row, self.span)


@dataclass(frozen=True)
class PushRoute:
    """Where a prompt's KV goes: from scratch slot `slot` of `source` into the reservation
    `blocks` of `dest` (blocks[i] holds tokens [i*B, (i+1)*B))."""

    source: KVLayout
    slot: int
    dest: BlockLayout
    blocks: Sequence[int]


def push_runs(
    route: PushRoute,
    layer: int,
    kv_index: int,
    end_token: int,
    start_token: int = 0,
    heads: range | None = None,
) -> list[Strided]:
    """What copies tokens [start_token, end_token) of (layer, K|V) from scratch slot `route.slot`
    of `route.source` into the reservation `route.blocks` of `route.dest`: one run per block
    (a partly used last block moves only its used tokens). `start_token` > 0 skips tokens the
    decode already holds (shared blocks), so a push never writes a block it does not own.

    `heads` (default: all both pools hold) are the KV heads moved. Where they are every head of
    both pools a block's tokens are one contiguous copy (copies 1); else each token's heads are
    a slice of its row, one copy per token (copies = the block's tokens)."""
    source, slot, dest, blocks = route.source, route.slot, route.dest, route.blocks
    check_compatible(source, dest)
    heads = shared_heads(source.head_range, dest.head_range) if heads is None else heads
    outside = [h for h in (heads.start, heads.stop - 1) if h not in source.head_range or h not in dest.head_range]
    if heads and outside:
        raise IndexError(f"heads {heads} are not held by both the source ({source.head_range}) and {dest.head_range}")
    bt = dest.block_tokens
    if not 0 <= start_token <= end_token:
        raise IndexError(f"token range {start_token}..{end_token} is empty or reversed")
    if end_token > len(blocks) * bt:
        raise IndexError(f"{end_token} tokens do not fit {len(blocks)} blocks of {bt}")
    if end_token == start_token or not heads:
        return []
    src_row, dst_row = source.bytes_per_token, dest.bytes_per_token
    cut = HeadSlice.of(heads, source.first_head, src_row, dest.first_head, dst_row, dest.head_dim * dest.dtype_size)
    src_base = source.token_run(slot, layer, kv_index, end_token - start_token, start_token)[0] - start_token * src_row
    runs: list[Strided] = []
    for i in range(start_token // bt, (end_token - 1) // bt + 1):
        lo, hi = max(start_token, i * bt), min(end_token, (i + 1) * bt)
        dst = dest.offset(layer, kv_index, blocks[i]) + (lo - i * bt) * dst_row
        runs.append(cut.run(src_base + lo * src_row, dst, hi - lo))
    return runs


def push_descriptors(
    route: PushRoute,
    layers: range,
    end_token: int,
    start_token: int = 0,
    kv_indices: Sequence[int] = (K, V),
    heads: range | None = None,
) -> list[Descriptor]:
    """`push_runs` of every (layer, K|V) of `layers` along `route`, as descriptors: one per
    (layer, K|V, run of consecutive blocks) for whole rows, one per token for a head slice."""
    runs = [
        run
        for layer in layers
        for kv_index in kv_indices
        for run in push_runs(route, layer, kv_index, end_token, start_token, heads)
    ]
    return [d for run in coalesce(runs) for d in run.descriptors()]


def block_spans(dest: BlockLayout, blocks: Sequence[int]) -> list[tuple[int, int]]:
    """(offset, length) ranges of the pool that hold `blocks` in every layer: what a write lease
    covers, what a warmup touches. One range per (layer, K|V, run)."""
    spans: list[tuple[int, int]] = []
    runs = block_runs(sorted(set(blocks)))
    for layer in dest.layer_range:
        for kv_index in (K, V):
            for run in runs:
                spans.append((dest.offset(layer, kv_index, run.block), run.count * dest.bytes_per_block))
    merged: list[tuple[int, int]] = []
    for off, length in spans:
        if merged and merged[-1][0] + merged[-1][1] == off:
            merged[-1] = (merged[-1][0], merged[-1][1] + length)
        else:
            merged.append((off, length))
    return merged
