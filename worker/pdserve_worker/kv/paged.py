"""A block-paged KV pool as a tensor, and the block table of each request handle.

The pool is a paged `KVLayout`'s shape — (layer, K|V, block, token-in-block, kv_head, head_dim),
`layout.blocks` — over
memory that someone else may own (a decode's registered pool, which prefills write into), so,
like `KVCache`, it only ever views the tensor it is given. Per layer, K and V are viewed flat
as `[num_blocks * block_tokens, kv_heads, head_dim]`: token j of a request whose block table
is `t` lives at row `t[j // B] * B + j % B`, which is all the model needs to write and gather.

Which blocks a request reads is bound to its *handle* (the reservation's `slot`, kv/blocks.py)
with `bind`, by whoever owns the reservation (the decode when the KV is committed, the
colocated loop when it admits a prompt), and unbound when the request ends. The model asks
`table(slot)`; an unbound handle is an error, never a read of someone else's blocks.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from pdserve_common.kv_layout import K, KVLayout, V, local_layer_index
from pdserve_worker.kv.cache import torch_dtype


class PagedKVCache:
    """A block pool viewed per layer as flat token rows, with a block table per handle.

    `layout` is the paged KVLayout (what the Generator reads: `num_slots` handles, `max_len` per
    request, the layer range); `blocks` its block geometry."""

    def __init__(self, layout: KVLayout, tensor: torch.Tensor) -> None:
        if not layout.paged:
            raise ValueError(f"a PagedKVCache needs a paged layout (block_tokens > 0), got {layout}")
        if tuple(tensor.shape) != layout.shape:
            raise ValueError(f"block pool tensor has shape {tuple(tensor.shape)}, layout needs {layout.shape}")
        if tensor.dtype != torch_dtype(layout.dtype):
            raise ValueError(f"block pool tensor has dtype {tensor.dtype}, layout needs {layout.dtype}")
        if not tensor.is_contiguous():
            raise ValueError(f"block pool tensor must be contiguous, got strides {tensor.stride()}")
        self.layout = layout
        self.blocks = layout.blocks
        self.tensor = tensor
        rows = layout.num_blocks * layout.block_tokens
        self._keys = [tensor[i, K].view(rows, layout.kv_heads, layout.head_dim) for i in range(layout.num_layers)]
        self._values = [tensor[i, V].view(rows, layout.kv_heads, layout.head_dim) for i in range(layout.num_layers)]
        self._tables: dict[int, tuple[int, ...]] = {}
        self._lock = threading.Lock()

    @classmethod
    def allocate(cls, layout: KVLayout, device: str | torch.device = "cpu") -> PagedKVCache:
        return cls(layout, torch.zeros(layout.shape, dtype=torch_dtype(layout.dtype), device=device))

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @property
    def block_tokens(self) -> int:
        return self.layout.block_tokens

    def local_layer(self, layer: int) -> int:
        return local_layer_index(self.layout.layer_range, layer)

    def keys(self, layer: int) -> torch.Tensor:
        """Flat rows `[num_blocks * block_tokens, kv_head, head_dim]` of layer `layer`'s keys."""
        return self._keys[self.local_layer(layer)]

    def values(self, layer: int) -> torch.Tensor:
        return self._values[self.local_layer(layer)]

    # ---- block tables ------------------------------------------------------------------------------
    def bind(self, slot: int, blocks: Sequence[int]) -> None:
        """Handle `slot` reads and writes `blocks` (in token order) until `unbind`."""
        table = tuple(int(b) for b in blocks)
        if not table:
            raise ValueError(f"handle {slot} bound to no blocks")
        bad = [b for b in table if not 0 <= b < self.layout.num_blocks]
        if bad:
            raise IndexError(f"blocks {bad} outside pool of {self.layout.num_blocks} blocks")
        with self._lock:
            self._tables[slot] = table

    def unbind(self, slot: int) -> None:
        with self._lock:
            self._tables.pop(slot, None)

    def table(self, slot: int) -> tuple[int, ...]:
        with self._lock:
            table = self._tables.get(slot)
        if table is None:
            raise KeyError(f"KV handle {slot} has no block table bound")
        return table

    def capacity(self, slot: int) -> int:
        """Tokens handle `slot` can hold."""
        return len(self.table(slot)) * self.layout.block_tokens

    def token_rows(self, slot: int, start: int, stop: int) -> torch.Tensor:
        """Flat rows of tokens [start, stop) of handle `slot` (long, on the pool's device)."""
        table = self.table(slot)
        bt = self.layout.block_tokens
        if start < 0 or stop > len(table) * bt or start > stop:
            raise IndexError(f"tokens {start}..{stop} outside handle {slot}'s {len(table) * bt}")
        return rows_of(table, bt, start, stop, self.device)

    def __repr__(self) -> str:
        return f"PagedKVCache(layout={self.layout!r}, device={self.device}, bound={len(self._tables)})"


def rows_of(
    table: Sequence[int], block_tokens: int, start: int, stop: int, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """Flat pool rows of tokens [start, stop) of a block table: `table[j // B] * B + j % B`."""
    j = torch.arange(start, stop)
    blocks = torch.as_tensor(table, dtype=torch.long)[j // block_tokens]
    return (blocks * block_tokens + j % block_tokens).to(device)
