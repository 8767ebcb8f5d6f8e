"""The README's reference parts stay true: metric names, quoted error messages, paths."""

from __future__ import annotations

import re
from pathlib import Path

import kopf
import pytest

from pdserve_worker.api.metrics import RouterMetrics

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def section(title: str) -> str:
    start = README.index(f"## {title}")
    end = README.find("\n## ", start + 3)
    return README[start : end if end > 0 else None]


def exposed_metric_names() -> set[str]:
    names = set()
    for family in RouterMetrics().registry.collect():
        names.add(f"{family.name}_total" if family.type == "counter" else family.name)
    return names


def test_metrics_table_lists_exactly_what_routers_expose() -> None:
    documented = set(re.findall(r"`(pdserve_router_\w+)`", section("Metrics")))
    assert documented == exposed_metric_names()


def test_metrics_table_lists_exactly_what_workers_expose() -> None:
    from pdserve_worker.serving.worker_metrics import WorkerMetrics

    exposed = set()
    for role in ("prefill", "decode"):
        metrics = WorkerMetrics(role)
        if role == "prefill":
            from pdserve_worker.kv.disk_tier import DiskTierStats
            from pdserve_worker.kv.prefix_cache import PrefixCache
            from pdserve_worker.kv.prefix_store import TierStats

            tiers = TierStats(0, 0, DiskTierStats(*([0] * 9), 0.0, 0.0))
            # With a prefix cache and a disk tier: every series.
            metrics.watch_prefill(lambda: 0, PrefixCache(4, 16).stats, lambda t=tiers: t, 1024)
        else:
            from pdserve_worker.decode.generation_loop import LoopStats

            metrics.watch_decode(lambda: 0, 4, lambda: 0, LoopStats, kv_tokens=lambda: (0, 64))
            metrics.watch_decode_prefix(lambda: 0, lambda: 0)  # (with a prefix cache: every series)
        for family in metrics.registry.collect():
            exposed.add(f"{family.name}_total" if family.type == "counter" else family.name)
    documented = set(re.findall(r"`(pdserve_(?:prefill|decode|kv)_\w+)`", section("Metrics")))
    assert documented == exposed


# Messages the troubleshooting table quotes, and where they come from.
SOURCES = [ROOT / "operator", ROOT / "worker", ROOT / "common", Path(kopf.__file__).parent]
QUOTED = [
    "resourceName is required when type is npu or cuda",
    "transfer.backend hixl needs device.type npu",
    "pollIntervalMicros is only meaningful with readiness poll",
    "nodePort needs type NodePort or LoadBalancer",
    "metadata.name must be at most",
    "shards exceed the",
    "unknown built-in model",
    "registered with the broker",
    "is owned by another controller",
    "ReplicaFailure",
    "ProgressDeadlineExceeded",
    "DriftReverted",
    "InvalidSpec",
    "token is not valid for any service here",
    "token does not grant access to service",
    "register again",
    "Pausing operations in favour of",
    "peering_missing",
    "peering_missing_standalone",
]


@pytest.mark.parametrize("message", QUOTED)
def test_troubleshooting_quotes_messages_the_code_really_emits(message: str) -> None:
    assert message in section("Troubleshooting")
    for base in SOURCES:
        for path in base.rglob("*.py"):
            if message in path.read_text(errors="replace"):
                return
    pytest.fail(f"{message!r} is quoted in the README but emitted nowhere")


def test_paths_the_readme_names_exist() -> None:
    paths = set(re.findall(r"`((?:manifests|charts|docs|scripts|operator|worker|common)/[\w./-]+)`", README))
    paths |= set(re.findall(r"-f ((?:manifests|operator|worker)/[\w./-]+)", README))
    assert paths
    missing = sorted(p for p in paths if not (ROOT / p.rstrip("/")).exists())
    assert not missing, missing
