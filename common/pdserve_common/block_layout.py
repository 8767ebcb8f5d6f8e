"""Where each byte of a block-paged KV pool lives, and which descriptors move a prompt into it (pure).

A decode pool of blocks is layer-major: `(layer, K|V, block, token-in-block, kv_head,
head_dim)`. Layer-major rather than block-major because a prefill pushes per layer chunk and
its source (a scratch slot, pdserve_common/kv_layout.py) is token-major per (layer, K|V): with the layer
outermost, a run of consecutive blocks of one (layer, K|V) is one contiguous range on both
sides, so it moves as one descriptor — a reservation granted in consecutive blocks (what a
fresh or lightly used pool hands out, kv/blocks.py) costs exactly the descriptors of a slot
today. A fragmented reservation costs one descriptor per run, never one per token.

It is also the layout paged attention reads (vLLM's per-layer `[num_blocks, block_size,
kv_heads, head_dim]`; on NPU torch_npu's paged attention takes the same per-layer cache), so a
layer's K is one strided view and a block table indexes it directly.

A pool may hold only a layer range (a member of a layer-sharded decode group): `first_layer`
and `num_layers` name it, and a layer outside it is an error, not a wrong offset.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from pdserve_common.kv_layout import DTYPE_SIZES, K, KVLayout, V


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

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_tokens", "num_layers", "kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"BlockLayout.{name} must be a positive int, got {value!r}")
        if self.first_layer < 0:
            raise ValueError(f"BlockLayout.first_layer must be >= 0, got {self.first_layer!r}")
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"BlockLayout.dtype must be one of {sorted(DTYPE_SIZES)}, got {self.dtype!r}")

    @property
    def dtype_size(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def layer_range(self) -> range:
        return range(self.first_layer, self.first_layer + self.num_layers)

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

    @classmethod
    def for_budget(
        cls,
        kv_tokens: int,
        block_tokens: int,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: str = "bfloat16",
        first_layer: int = 0,
    ) -> BlockLayout:
        """The pool that holds `kv_tokens` tokens (rounded down to whole blocks)."""
        if kv_tokens < block_tokens:
            raise ValueError(f"kv_tokens ({kv_tokens}) must hold at least one block of {block_tokens} tokens")
        return cls(kv_tokens // block_tokens, block_tokens, num_layers, kv_heads, head_dim, dtype, first_layer)


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
class Descriptor:
    """One contiguous copy: `length` bytes from `src` (source offset) to `dst` (pool offset)."""

    src: int
    dst: int
    length: int


def _coalesce(pieces: Iterable[Descriptor]) -> list[Descriptor]:
    """Merge pieces that continue one another on both sides (so the merge is always exact)."""
    out: list[Descriptor] = []
    for d in pieces:
        if d.length == 0:
            continue
        if out and out[-1].src + out[-1].length == d.src and out[-1].dst + out[-1].length == d.dst:
            last = out[-1]
            out[-1] = Descriptor(last.src, last.dst, last.length + d.length)
        else:
            out.append(d)
    return out


def check_compatible(source: KVLayout, dest: BlockLayout) -> None:
    """A source slot and a block pool hold the same KV geometry (else the bytes would be garbage)."""
    mine = (source.kv_heads, source.head_dim, source.dtype)
    theirs = (dest.kv_heads, dest.head_dim, dest.dtype)
    if mine != theirs:
        raise ValueError(f"KV geometry differs: source (kv_heads, head_dim, dtype)={mine}, block pool {theirs}")


def push_descriptors(
    source: KVLayout,
    slot: int,
    dest: BlockLayout,
    blocks: Sequence[int],
    layers: range,
    end_token: int,
    start_token: int = 0,
    kv_indices: Sequence[int] = (K, V),
) -> list[Descriptor]:
    """Descriptors that copy tokens [start_token, end_token) of `layers` from scratch slot `slot`
    of `source` into the reservation `blocks` of `dest` (blocks[i] holds tokens [i*B, (i+1)*B)).

    One descriptor per (layer, K|V, run of consecutive blocks); a partly used last block moves
    only its used tokens. `start_token` > 0 skips tokens the decode already holds (shared
    blocks), so a push never writes a block it does not own."""
    check_compatible(source, dest)
    bt = dest.block_tokens
    if not 0 <= start_token <= end_token:
        raise IndexError(f"token range {start_token}..{end_token} is empty or reversed")
    if end_token > len(blocks) * bt:
        raise IndexError(f"{end_token} tokens do not fit {len(blocks)} blocks of {bt}")
    if end_token == start_token:
        return []
    per_token = dest.bytes_per_token
    pieces: list[Descriptor] = []
    for layer in layers:
        for kv_index in kv_indices:
            src_base = source.token_run(slot, layer, kv_index, end_token - start_token, start_token)[0]
            src_base -= start_token * per_token
            for i in range(start_token // bt, (end_token - 1) // bt + 1):
                lo, hi = max(start_token, i * bt), min(end_token, (i + 1) * bt)
                dst = dest.offset(layer, kv_index, blocks[i]) + (lo - i * bt) * per_token
                pieces.append(Descriptor(src_base + lo * per_token, dst, (hi - lo) * per_token))
    return _coalesce(pieces)


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
