"""A prefill's cached prefix KV: the `PrefixCache` bookkeeping plus the tensor that holds its blocks.

The store sits beside the prefill's scratch slots (kv/cache.py, which stay the push source:
token-major, one contiguous run per layer and K|V). A prefill with a cached prefix copies the
hit blocks into its scratch slot, computes only the rest from there (`LlamaModel.prefill(...,
start=)`), and pushes the whole KV as before; afterwards it copies the prompt's new whole
blocks out into the store and publishes them. Copy in and out rather than attention straight
over the store because a copy is a memcpy of ~23 KB per token (the default model, bf16) while
the prefill computes at ~1,000 tokens/s: the copy costs well under 1% of what it saves, and the
push path, the chunk pipelining and the packed multi-prompt pass stay exactly as they are.

The store's memory is the bound: `num_blocks` blocks of `block_tokens` tokens of every layer,
fixed at start (`prefill.prefixCacheTokens`; unset, a share of the process's memory:
kv/memory_budget.py, `open_prefix_store`). The tensor is allocated empty, not zeroed: a block is
read only after `finish` wrote it, so pages of a budget that is never filled are never touched.

Use, on the compute thread, exactly as:
    use = store.begin(prompt, cache, slot, scope)  # hits copied in; use.cached_tokens of the prompt
    ... model.prefill(prompt, cache, slot, start=use.cached_tokens) ...
    store.finish(use, cache, slot)            # new whole blocks copied out and published
    store.end(use)                            # always (finally): unpins, exactly once
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve_common.kv_layout import KVLayout
from pdserve_common.logs import kv
from pdserve_worker.kv.cache import KVCache, torch_dtype
from pdserve_worker.kv.memory_budget import prefix_budget
from pdserve_worker.kv.prefix_cache import (
    PrefixCache,
    PrefixCacheStats,
    PrefixLease,
    block_hashes,
    cache_salt,
    scoped_salt,
)


@dataclass
class PrefixUse:
    lease: PrefixLease
    hashes: list[bytes]
    cached_tokens: int
    ended: bool = False


class PrefixStore:
    def __init__(
        self, layout: KVLayout, num_blocks: int, block_tokens: int, revision: str, device: str | torch.device = "cpu"
    ) -> None:
        if layout.max_len < block_tokens:
            raise ValueError(f"prefix block of {block_tokens} tokens is longer than a prompt may be ({layout.max_len})")
        self.layout = layout
        self.block_tokens = block_tokens
        self.salt = cache_salt(revision, layout.dtype, block_tokens)
        self.cache = PrefixCache(num_blocks, block_tokens)
        # [block, layer, K|V, token, kv_head, head_dim]: one block of every layer is one slice.
        shape = (num_blocks, layout.num_layers, 2, block_tokens, layout.kv_heads, layout.head_dim)
        self.blocks = torch.empty(shape, dtype=torch_dtype(layout.dtype), device=device)

    @property
    def nbytes(self) -> int:
        return int(self.blocks.numel() * self.blocks.element_size())

    def hashes(self, prompt: Sequence[int], scope: str) -> list[bytes]:
        """The prompt's block names within `scope` (router/cache_scope.py): another scope's
        prompt of the same tokens has other names, so it neither finds nor feeds these blocks."""
        return block_hashes(prompt, self.block_tokens, scoped_salt(self.salt, scope))

    def begin(self, prompt: Sequence[int], cache: KVCache, slot: int, scope: str) -> PrefixUse:
        """Pin the longest cached prefix of `scope` (leaving at least one token to compute),
        copy it into `slot` of `cache`, and reserve blocks for the prompt's other whole blocks."""
        self._check(cache)
        hashes = self.hashes(prompt, scope)
        lease = self.cache.acquire(hashes, limit=(len(prompt) - 1) // self.block_tokens)
        try:
            bt = self.block_tokens
            dest = cache.slot(slot)  # [layer, K|V, token, kv_head, head_dim]
            for i, block in enumerate(lease.hits):
                dest[:, :, i * bt : (i + 1) * bt] = self.blocks[block]
            self.cache.reserve_fills(lease, hashes)
        except BaseException:
            self.cache.release(lease)
            raise
        return PrefixUse(lease, hashes, lease.hit_blocks * bt)

    def finish(self, use: PrefixUse, cache: KVCache, slot: int) -> None:
        """The prompt's KV is final in `slot`: copy the reserved blocks out and publish them."""
        bt = self.block_tokens
        source = cache.slot(slot)
        for index, block in use.lease.fills:
            self.blocks[block] = source[:, :, index * bt : (index + 1) * bt]
        self.cache.publish(use.lease)

    def end(self, use: PrefixUse) -> None:
        """Unpin what `begin` pinned; a second call does nothing (every path may call it)."""
        if not use.ended:
            use.ended = True
            self.cache.release(use.lease)

    def stats(self) -> PrefixCacheStats:
        return self.cache.stats()

    def _check(self, cache: KVCache) -> None:
        mine, theirs = self.layout, cache.layout
        if (mine.num_layers, mine.first_layer, mine.kv_heads, mine.head_dim, mine.dtype) != (
            theirs.num_layers,
            theirs.first_layer,
            theirs.kv_heads,
            theirs.head_dim,
            theirs.dtype,
        ):
            raise ValueError(f"prefix store geometry {mine} does not match the scratch pool {theirs}")


def kv_bytes_per_token(layout: KVLayout) -> int:
    """One token's K and V over every layer of `layout`: what a cached token costs."""
    return layout.num_layers * 2 * layout.bytes_per_token


def open_prefix_store(
    layout: KVLayout,
    requested: int | None,
    memory_share: float,
    block_tokens: int,
    revision: str,
    device: str | torch.device = "cpu",
    logger: logging.Logger | None = None,
) -> PrefixStore | None:
    """The prefill's prefix cache: `requested` tokens (0: none), or when None a share of the
    process's memory (kv/memory_budget.py). Logs what it chose and why, once, at start."""
    budget = prefix_budget(requested, memory_share, kv_bytes_per_token(layout), block_tokens, str(device))
    blocks = (
        budget.tokens // block_tokens if requested is None else (max(1, requested // block_tokens) if requested else 0)
    )
    log = logger or logging.getLogger("pdserve.prefix")
    mode = "auto" if requested is None else "set"
    if blocks < 1:
        log.info(kv(event="prefix_cache_off", mode=mode, **budget.describe()))
        return None
    store = PrefixStore(layout, blocks, block_tokens, revision, device=device)
    log.info(kv(event="prefix_cache", mode=mode, blocks=blocks, block_tokens=block_tokens, **budget.describe()))
    return store
