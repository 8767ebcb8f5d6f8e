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


def listening_rank(rank: int, size: int, store: str, ifname: str | None, out: Any, done: Any) -> None:
    """Join a group (with GLOO_SOCKET_IFNAME=`ifname` set beforehand, as a pod's environment
    might), check it sums, put (rank, its listening TCP sockets as (address, port)) on `out`,
    and stay in the group until `done` is set."""
    import os

    import torch

    from pdserve_worker.ranks.group import GroupSpec, TPGroup

    if ifname is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = ifname
    group = TPGroup(GroupSpec(size, rank, store, timeout_s=60))
    try:
        total = group.all_reduce(torch.ones(1))
        lease = group.lease_broadcast("lease" if rank == 0 else None)
        out.put((rank, float(total[0]), lease, os.environ.get("GLOO_SOCKET_IFNAME"), listening_sockets(os.getpid())))
        done.wait(120)
    finally:
        group.close()


def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """The TCP sockets process `pid` listens on: (address, port), from /proc."""
    import ipaddress
    import os

    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in open(f"/proc/{pid}/net/{table}").read().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            hex_addr, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_addr)
            # /proc prints each 32-bit word of the address in host (little-endian) order.
            words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found.append((str(ipaddress.ip_address(words)), int(hex_port, 16)))
    return found
