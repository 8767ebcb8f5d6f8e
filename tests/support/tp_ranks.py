"""Rank processes of a tensor-parallel group for tests: spawned by torch.multiprocessing, each
loads its share of a model and runs what the test asks, rank 0 reporting the result."""

from __future__ import annotations

from typing import Any


def greedy_rank(rank: int, size: int, store: str, jobs: list[tuple[str, list[list[int]], int]], out: Any) -> None:
    """For each (folder, prompts, count): greedy tokens of every prompt, with this rank's share of
    the model; rank 0 puts {folder: [tokens per prompt]} on `out`, with each rank's KV bytes."""
    import torch

    from pdserve_worker.kv.cache import KVCache
    from pdserve_worker.model.engine import greedy_tokens
    from pdserve_worker.model.loading.loader import load_model
    from pdserve_worker.ranks.group import GroupSpec, TPGroup

    torch.set_num_threads(1)
    group = TPGroup(GroupSpec(size, rank, store, timeout_s=60))
    try:
        results: dict[str, Any] = {}
        for folder, prompts, count in jobs:
            loaded = load_model(folder, dtype="float32", tp=(size, rank), reduce=group.all_reduce)
            tokens = []
            for ids in prompts:
                cache = KVCache.allocate(loaded.config.kv_layout(1, len(ids) + count + 1, "float32"))
                tokens.append(greedy_tokens(loaded.model, cache, 0, ids, count))
            kv_heads = group.gather(loaded.config.num_kv_heads)
            results[folder] = (tokens, kv_heads)
        if rank == 0:
            out.put(results)
    finally:
        group.close()
