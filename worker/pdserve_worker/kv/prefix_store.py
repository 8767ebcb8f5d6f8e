"""A prefill's cached prefix KV: the `PrefixCache` bookkeeping plus the tensor that holds its blocks.

The store sits beside the prefill's scratch slots (kv/cache.py, still the push source). A
prefill copies its hit blocks into its scratch slot, computes only the rest there, pushes the
whole KV as before, then copies the prompt's new whole blocks out and publishes them (copy
rather than attention over the store: benchmarks/README.md, "kv/prefix_store.py").
`num_blocks` blocks of every layer, fixed at start (`open_prefix_store`); the tensor is
allocated empty. With a disk tier (kv/disk_tier.py) every published block is also spilled
to disk, and blocks only the disk holds are loaded from `prefetch` on and installed by `begin`.
Use, on the compute thread, exactly as:
    use = store.begin(prompt, cache, slot, scope[, prefetched])  # hits copied in; use.cached_tokens
    ... model.prefill(prompt, cache, slot, start=use.cached_tokens) ...
    store.finish(use, cache, slot)            # new whole blocks copied out and published
    store.end(use)                            # always (finally): unpins, exactly once
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pdserve_common.kv_layout import KVLayout
from pdserve_common.logs import kv
from pdserve_worker.kv.block_events import BlockEventLog
from pdserve_worker.kv.cache import KVCache, torch_dtype
from pdserve_worker.kv.disk_tier import DiskTier, DiskTierStats
from pdserve_worker.kv.memory_budget import DEFAULT_DISK_BYTES, prefix_budget
from pdserve_worker.kv.prefix_cache import (
    PrefixCache,
    PrefixCacheStats,
    PrefixLease,
    block_hashes,
    cache_salt,
    scoped_salt,
)

log = logging.getLogger(__name__)

PREFETCH_WAIT_S = 2.0  # the longest a prompt whose blocks are on disk waits for them (then: computed)

Loaded = list[tuple[bytes, memoryview]]  # (block hash, its bytes) read from the disk tier, in chain order


@dataclass
class PrefixUse:
    lease: PrefixLease
    hashes: list[bytes]
    cached_tokens: int
    disk_tokens: int = 0  # of cached_tokens, those read back from the disk tier
    ended: bool = False


@dataclass(frozen=True)
class TierStats:
    ram_hit_blocks: int  # blocks a prompt found in RAM
    disk_hit_blocks: int  # blocks a prompt found only on disk (read back)
    disk: DiskTierStats | None


class PrefixStore:
    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        block_tokens: int,
        revision: str,
        device: str | torch.device = "cpu",
        disk: DiskTier | None = None,
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
        if disk is not None and (self.blocks.device.type != "cpu" or disk.payload_bytes != self.block_bytes):
            raise ValueError(
                f"a disk tier needs host blocks of {self.block_bytes} bytes, got {self.blocks.device} "
                f"and {disk.payload_bytes} bytes"
            )
        self.disk = disk
        self.events = BlockEventLog(self._held)  # what routers follow (Prefill.BlockEvents)
        self.cache.events = self.events
        if disk is not None:
            disk.events = self.events
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="prefix-disk-loader") if disk is not None else None
        self._ram_hits = self._disk_hits = 0

    @property
    def block_bytes(self) -> int:
        return int(self.blocks[0].numel() * self.blocks.element_size())

    @property
    def nbytes(self) -> int:
        return int(self.blocks.numel() * self.blocks.element_size())

    def hashes(self, prompt: Sequence[int], scope: str) -> list[bytes]:
        """The prompt's block names within `scope` (api/cache_scope.py): another scope's
        prompt of the same tokens has other names, so it neither finds nor feeds these blocks."""
        return block_hashes(prompt, self.block_tokens, scoped_salt(self.salt, scope))

    def prefetch(self, prompt: Sequence[int], scope: str) -> Future[Loaded] | None:
        """Start reading the prompt's blocks that only the disk tier holds (any thread; no I/O
        here: the disk's index is in memory). None when there is nothing to read."""
        if self.disk is None or self._loader is None:
            return None
        wanted = []
        for h in self.hashes(prompt, scope)[: (len(prompt) - 1) // self.block_tokens]:
            if self.cache.lookup(h) is not None:
                continue
            if not self.disk.has(h):
                break  # the chain ends here: what follows is computed anyway
            wanted.append(h)
        return self._loader.submit(self._read, wanted) if wanted else None

    def begin(
        self, prompt: Sequence[int], cache: KVCache, slot: int, scope: str, prefetched: Future[Loaded] | None = None
    ) -> PrefixUse:
        """Pin the longest cached prefix of `scope` (leaving at least one token to compute),
        copy it into `slot` of `cache`, and reserve blocks for the prompt's other whole blocks.
        With a disk tier, the prompt's blocks read from disk (`prefetched`, else read now) are
        installed in RAM first."""
        self._check(cache)
        from_disk = self._install(prefetched if prefetched is not None else self.prefetch(prompt, scope))
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
        disk_hits = sum(1 for h in hashes[: lease.hit_blocks] if h in from_disk)
        self._disk_hits += disk_hits
        self._ram_hits += lease.hit_blocks - disk_hits
        return PrefixUse(lease, hashes, lease.hit_blocks * bt, disk_hits * bt)

    def finish(self, use: PrefixUse, cache: KVCache, slot: int) -> None:
        """The prompt's KV is final in `slot`: copy the reserved blocks out and publish them
        (and, with a disk tier, hand a copy of each to its writer)."""
        bt = self.block_tokens
        source = cache.slot(slot)
        for index, block in use.lease.fills:
            self.blocks[block] = source[:, :, index * bt : (index + 1) * bt]
        self.cache.publish(use.lease)
        if self.disk is not None:
            for (_, block), h in zip(use.lease.fills, use.lease.fill_hashes, strict=True):
                if self.cache.lookup(h) == block:  # ours was published (not a duplicate of another's)
                    self._spill(h, block)

    def close(self) -> None:
        """Stop the disk tier's threads after what they hold is written (a graceful stop)."""
        if self._loader is not None:
            self._loader.shutdown(wait=True, cancel_futures=True)
        if self.disk is not None:
            self.disk.close()

    def _held(self) -> list[tuple[bool, bytes]]:
        ram = [(False, h) for h in self.cache.held()]
        return ram + ([(True, h) for h in self.disk.held()] if self.disk is not None else [])

    def tier_stats(self) -> TierStats:
        return TierStats(self._ram_hits, self._disk_hits, self.disk.stats() if self.disk is not None else None)

    # ---- the disk tier ------------------------------------------------------------------------------
    def _read(self, wanted: list[bytes]) -> Loaded:
        assert self.disk is not None
        out: Loaded = []
        for h in wanted:
            payload = self.disk.read(h)
            if payload is None:
                break  # corrupt or gone: this block and the rest of the chain are computed
            out.append((h, payload))
        return out

    def _install(self, prefetched: Future[Loaded] | None) -> set[bytes]:
        """Copy blocks read from disk into free (or LRU-evicted) RAM blocks and publish them."""
        if prefetched is None:
            return set()
        try:
            loaded = prefetched.result(timeout=PREFETCH_WAIT_S)
        except FutureTimeout:
            log.warning(kv(event="prefix_disk_slow", wait_s=PREFETCH_WAIT_S))
            return set()
        if not loaded:
            return set()
        lease = PrefixLease()
        try:
            fills = self.cache.reserve_fills(lease, [h for h, _ in loaded])
            for index, block in fills:
                self.blocks[block].view(torch.uint8).view(-1).copy_(
                    torch.frombuffer(loaded[index][1], dtype=torch.uint8)
                )
            self.cache.publish(lease)
        finally:
            self.cache.release(lease)
        return {loaded[index][0] for index, _ in fills}

    def _spill(self, h: bytes, block: int) -> None:
        """Copy the block (a memcpy; the compute that made it took ~100x longer) and queue it."""
        assert self.disk is not None
        if not self.disk.has(h):
            self.disk.spill(h, self.blocks[block].view(torch.uint8).reshape(-1).numpy().tobytes())

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


@dataclass(frozen=True)
class PrefixStoreConfig:
    """What a prefill's prefix cache is asked for: `requested` tokens (0: none; None: a share
    `memory_share` of the process's memory, kv/memory_budget.py) in blocks of `block_tokens`,
    for model `revision`; with `disk_dir`, a disk tier of `disk_bytes` there (0:
    DEFAULT_DISK_BYTES, 10 GiB), its files' digests keyed with `disk_key`."""

    requested: int | None
    memory_share: float
    block_tokens: int
    revision: str
    disk_dir: Path | None = None
    disk_bytes: int = 0
    disk_key: bytes = field(default=b"", repr=False)


def open_prefix_store(
    layout: KVLayout,
    config: PrefixStoreConfig,
    device: str | torch.device = "cpu",
    logger: logging.Logger | None = None,
) -> PrefixStore | None:
    """The prefill's prefix cache as `config` asks, or None when it comes to no block (a warning
    at start if the disk tier's capacity is over the disk's free space). Logs what it chose and
    why, once, at start, on `logger` (default: this module's)."""
    requested, bt = config.requested, config.block_tokens
    budget = prefix_budget(requested, config.memory_share, kv_bytes_per_token(layout), bt, str(device))
    blocks = budget.tokens // bt if requested is None else (max(1, requested // bt) if requested else 0)
    out = logger or log
    mode = "auto" if requested is None else "set"
    if blocks < 1:
        out.info(kv(event="prefix_cache_off", mode=mode, **budget.describe()))
        return None
    disk = None
    if config.disk_dir is not None:
        capacity = config.disk_bytes or DEFAULT_DISK_BYTES
        geometry = disk_geometry(layout, bt, config.revision)
        disk = DiskTier(config.disk_dir, capacity, geometry, bt * kv_bytes_per_token(layout), config.disk_key)
        free = shutil.disk_usage(disk.folder).free
        if capacity > free:  # said at start, not found out when the disk fills
            out.warning(
                kv(event="prefix_disk_over_free", capacity_bytes=capacity, free_bytes=free, folder=str(disk.folder))
            )
        out.info(kv(event="prefix_disk_tier", folder=str(disk.folder), capacity_bytes=capacity, **_files(disk)))
    store = PrefixStore(layout, blocks, bt, config.revision, device=device, disk=disk)
    out.info(kv(event="prefix_cache", mode=mode, blocks=blocks, block_tokens=bt, **budget.describe()))
    return store


def disk_geometry(layout: KVLayout, block_tokens: int, revision: str) -> str:
    """What a block file's bytes depend on besides its hash: a restart with another model,
    dtype or layer range finds none of the old files (they sit in another folder)."""
    g = layout
    return f"{revision}|{g.dtype}|{g.num_layers}|{g.first_layer}|{g.kv_heads}|{g.head_dim}|{block_tokens}"


def _files(disk: DiskTier) -> dict[str, int]:
    st = disk.stats()
    return {"files": st.files, "bytes": st.bytes}
