"""How much prefix-cache KV a prefill keeps when nobody says: a share of its memory.

An unset `prefixCacheTokens` / `--prefix-cache-tokens` means auto, and 0 turns the cache off:
    budget = PREFIX_CACHE_FRACTION x (memory limit x share)
             capped so that what the process already holds plus the budget leaves HEADROOM free
- the memory limit is the cgroup's (v2 memory.max, v1 memory.limit_in_bytes), else MemTotal;
- `share` is the part of it this process may count as its own: 1 in a pod, 1 / (model
  processes) under `pdserve local`, where they share one machine;
- the cap uses the resident set after the weights and the scratch pool are in, so a model that
  already fills its pod gets a small cache or none, never an out-of-memory kill;
- on an accelerator the limit is the device's free memory after weights and pool
  (`mem_get_info`), and nothing more is subtracted.
The store's tensor is allocated empty (kv/prefix_store.py): a large, mostly idle budget costs
address space, not memory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PREFIX_CACHE_FRACTION = 0.25  # of the memory the process counts as its own
HEADROOM_FRACTION = 0.10  # of it, left free for activations and the allocator
MAX_AUTO_TOKENS = 1 << 22  # 4 Mi tokens: past this the bookkeeping, not the KV, is the cost
_UNLIMITED = 1 << 60  # cgroup v1 reports "no limit" as a number near 2**63

CGROUP_V2 = Path("/sys/fs/cgroup/memory.max")
CGROUP_V1 = Path("/sys/fs/cgroup/memory/memory.limit_in_bytes")
MEMINFO = Path("/proc/meminfo")


@dataclass(frozen=True)
class MemoryLimit:
    bytes: int
    source: str  # "cgroup v2", "cgroup v1" or "MemTotal"


def memory_limit(v2: Path = CGROUP_V2, v1: Path = CGROUP_V1, meminfo: Path = MEMINFO) -> MemoryLimit:
    """The memory this process's container may use: its cgroup limit, else the machine's."""
    for path, source in ((v2, "cgroup v2"), (v1, "cgroup v1")):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < _UNLIMITED:
            return MemoryLimit(int(text), source)
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemTotal:"):
            return MemoryLimit(int(line.split()[1]) * 1024, "MemTotal")
    raise RuntimeError(f"no MemTotal line in {meminfo}")


def resident_bytes(statm: Path = Path("/proc/self/statm")) -> int:
    """This process's resident set (weights, scratch pool, interpreter) in bytes."""
    return int(statm.read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class PrefixBudget:
    tokens: int
    bytes: int
    limit: MemoryLimit
    share: float
    resident: int

    def describe(self) -> dict[str, object]:
        """key=value fields for the start-up log line (pdserve_common.logs.kv)."""
        return {
            "tokens": self.tokens,
            "bytes": self.bytes,
            "limit_bytes": self.limit.bytes,
            "limit_source": self.limit.source,
            "share": round(self.share, 4),
            "resident_bytes": self.resident,
            "fraction": PREFIX_CACHE_FRACTION,
        }


def auto_prefix_tokens(
    limit_bytes: int, share: float, kv_bytes_per_token: int, block_tokens: int, resident: int = 0
) -> int:
    """Prefix-cache tokens, whole blocks, for a process that owns `share` of `limit_bytes` and
    already holds `resident` bytes; 0 when nothing can be spared (pure: see the module docstring)."""
    if kv_bytes_per_token <= 0 or block_tokens <= 0:
        raise ValueError(f"kv_bytes_per_token and block_tokens must be positive: {kv_bytes_per_token}, {block_tokens}")
    if not 0 < share <= 1:
        raise ValueError(f"memory share must be in (0, 1], got {share}")
    own = limit_bytes * share
    spare = own * (1 - HEADROOM_FRACTION) - resident
    budget = max(0.0, min(own * PREFIX_CACHE_FRACTION, spare))
    tokens = min(int(budget // kv_bytes_per_token), MAX_AUTO_TOKENS)
    return tokens // block_tokens * block_tokens


def device_free(device: str) -> MemoryLimit:
    """Free memory of the accelerator `device` ("npu", "cuda") as its torch backend reports it."""
    import torch

    module = getattr(torch, device.split(":")[0], None)
    if module is None or not hasattr(module, "mem_get_info"):
        raise RuntimeError(f"torch has no mem_get_info for device {device!r}: set the prefix cache size explicitly")
    free, _total = module.mem_get_info()
    return MemoryLimit(int(free), f"{device} free")


def own_memory(device: str) -> tuple[MemoryLimit, int]:
    """(the limit a cache on `device` is sized from, what this process holds of it already):
    the host's limit and resident set on the CPU, an accelerator's free memory (and 0) on it."""
    if str(device).split(":")[0] == "cpu":
        return memory_limit(), resident_bytes()
    return device_free(str(device)), 0


def prefix_budget(
    requested: int | None,
    share: float,
    kv_bytes_per_token: int,
    block_tokens: int,
    device: str = "cpu",
) -> PrefixBudget:
    """The prefix cache a worker builds: `requested` tokens when set (0: none), else auto."""
    try:
        limit, resident = own_memory(device)
    except RuntimeError:
        if requested is None:
            raise  # auto needs the limit; an explicit size only logs it
        limit, resident = MemoryLimit(0, "unknown"), 0
    if requested is None:
        tokens = auto_prefix_tokens(limit.bytes, share, kv_bytes_per_token, block_tokens, resident)
    else:
        tokens = requested
    return PrefixBudget(tokens, tokens * kv_bytes_per_token, limit, share, resident)


# The disk tier's bound per prefill when none is set: a fixed figure, not a share of the free
# space (two prefills on one node each took half the free disk, #58 A10).
DEFAULT_DISK_BYTES = 10 << 30


DECODE_KV_FRACTION = 0.5  # of its memory share: a decode's KV pool is most of what it holds


def auto_kv_tokens(
    wanted: int, limit_bytes: int, share: float, kv_bytes_per_token: int, block_tokens: int, resident: int = 0
) -> int:
    """A paged decode pool's tokens when none is set: what its slots can use (`wanted`, slots x
    max_len), capped so that the pool stays within DECODE_KV_FRACTION of the process's memory
    share and leaves HEADROOM_FRACTION free after what it holds; at least one block.

    Capped, never raised: more KV than the slots can fill buys nothing (the slot count is the
    concurrency cap), while a pool larger than the pod would be an OOM kill at the first long
    batch instead of a 429 at admission."""
    if kv_bytes_per_token <= 0 or block_tokens <= 0:
        raise ValueError(f"kv_bytes_per_token and block_tokens must be positive: {kv_bytes_per_token}, {block_tokens}")
    own = limit_bytes * share
    budget = max(0.0, min(own * DECODE_KV_FRACTION, own * (1 - HEADROOM_FRACTION) - resident))
    cap = int(budget // kv_bytes_per_token) // block_tokens * block_tokens
    return max(block_tokens, min(wanted // block_tokens * block_tokens, cap))
