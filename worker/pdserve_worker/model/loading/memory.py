"""Will the weights fit? Checked before loading, so a worker that cannot hold its model says so
(memory needed, memory available, where that figure came from) and exits before it registers,
instead of being OOM-killed half way through loading or, worse, after it took traffic.

Available memory: on an accelerator, the free device memory its runtime reports
(`torch.cuda.mem_get_info`, `torch.npu.mem_get_info`); on the CPU, the kernel's `MemAvailable`
and, inside a container, the cgroup's limit minus its working set (usage less inactive file
pages, the figure the kubelet evicts on), whichever is smaller.
"""

from __future__ import annotations

import logging
from pathlib import Path

from pdserve_common.logs import kv

log = logging.getLogger(__name__)

GIB = 1024**3


class ModelDoesNotFit(RuntimeError):
    """The weights need more memory than the device has available."""


def gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def _meminfo_available(path: Path = Path("/proc/meminfo")) -> int | None:
    try:
        for line in path.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_available(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """limit - (usage - inactive_file) of this process's cgroup (v2, else v1); None without a limit."""
    for limit_file, usage_file, stat_file, inactive_key in (
        ("memory.max", "memory.current", "memory.stat", "inactive_file"),
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat", "total_inactive_file"),
    ):
        try:
            raw = (root / limit_file).read_text().strip()
            if raw == "max" or int(raw) >= 1 << 60:  # v1 reports "no limit" as a huge number
                return None
            limit, usage = int(raw), int((root / usage_file).read_text())
        except (OSError, ValueError):
            continue
        inactive = 0
        try:
            for line in (root / stat_file).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == inactive_key:
                    inactive = int(value)
        except (OSError, ValueError):
            pass
        return max(0, limit - max(0, usage - inactive))
    return None


def host_available() -> tuple[int | None, str]:
    """(bytes available to this process on the host, where the figure came from)."""
    figures = {
        name: value
        for name, value in (("MemAvailable", _meminfo_available()), ("cgroup limit - working set", _cgroup_available()))
        if value is not None
    }
    if not figures:
        return None, "unknown"
    source = min(figures, key=figures.__getitem__)
    return figures[source], source


def device_available(device: object) -> tuple[int | None, str]:
    """(free bytes, source) on a torch device; the host figure for the CPU."""
    kind = getattr(device, "type", str(device).split(":", 1)[0])
    if kind == "cpu":
        return host_available()
    import torch

    if kind == "cuda":
        return int(torch.cuda.mem_get_info(device)[0]), "torch.cuda.mem_get_info"
    if kind == "npu":
        return int(torch.npu.mem_get_info(device)[0]), "torch.npu.mem_get_info"  # type: ignore[attr-defined]
    return None, "unknown"


def check_fits(needed: int, available: int | None, source: str, what: str, device: str) -> None:
    """Raise `ModelDoesNotFit` naming both figures when `needed` exceeds `available` (unknown passes)."""
    if available is None:
        log.warning(kv(event="memory_unknown", device=device, needed_bytes=needed))
        return
    if needed > available:
        raise ModelDoesNotFit(
            f"{what} need {gib(needed)} ({needed} bytes) but {device} has {gib(available)} ({available} bytes) "
            f"available ({source}); use a smaller dtype, more --layer-shards for decode, or a device with more memory"
        )
