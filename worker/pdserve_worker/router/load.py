"""What a router reports with each broker keepalive: its traffic, read from its own metrics.

The operator's autoscaler plans from it (`pdserve_operator.planner.signals`): cumulative
request and token counters, and the TTFT/TPOT histograms' cumulative buckets, exactly as
`/metrics` shows them — so the planner and a Prometheus dashboard see the same numbers, and
the router keeps no second bookkeeping of its own.
"""

from __future__ import annotations

import math

from prometheus_client import Counter
from prometheus_client import Histogram as PromHistogram

from pdserve_common.membership import Histogram, Load, RouterLoad
from pdserve_worker.api.metrics import RouterMetrics


def _counter_total(counter: Counter) -> int:
    """The sum over every label set of a counter (its `_total` samples)."""
    return int(sum(s.value for family in counter.collect() for s in family.samples if s.name.endswith("_total")))


def _histogram(hist: PromHistogram) -> Histogram:
    bounds: list[float] = []
    counts: list[int] = []
    total = 0
    for family in hist.collect():
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                le = float(sample.labels["le"])
                if math.isinf(le):
                    continue
                bounds.append(le)
                counts.append(int(sample.value))
            elif sample.name.endswith("_count"):
                total = int(sample.value)
    return Histogram(tuple(bounds), tuple(counts), total)


def router_load(metrics: RouterMetrics) -> Load:
    return Load(
        router=RouterLoad(
            requests_total=_counter_total(metrics.requests_completed) + _counter_total(metrics.requests_failed),
            prompt_tokens_total=_counter_total(metrics.prompt_tokens),
            output_tokens_total=_counter_total(metrics.generation_tokens),
            ttft=_histogram(metrics.time_to_first_token),
            tpot=_histogram(metrics.time_per_output_token),
        )
    )
