"""`pdserve top`: its quantiles are PromQL's, its rates the counters' deltas, its view readable."""

from __future__ import annotations

import math

import pytest

from pdserve_worker.api.backend import RequestInfo
from pdserve_worker.api.metrics import RequestTiming, RouterMetrics
from pdserve_worker.cli.top_view import parse, quantile, render, view

INF = math.inf


@pytest.mark.parametrize(
    ("q", "buckets", "expected"),
    [
        # Cases of prometheus/prometheus promql/quantile.go BucketQuantile, ported.
        (0.5, {0.1: 0, 0.5: 50, 1.0: 100, INF: 100}, 0.5),  # at a bucket bound
        (0.75, {0.1: 0, 0.5: 50, 1.0: 100, INF: 100}, 0.75),  # interpolated from the previous bound
        (0.05, {0.1: 10, 0.5: 50, 1.0: 100, INF: 100}, 0.05),  # first bucket: from 0
        (0.99, {0.1: 0, 0.5: 50, 1.0: 90, INF: 100}, 1.0),  # in +Inf: the second-highest bound
        (0.75, {-1.0: 10, 0.5: 20, INF: 20}, -0.25),  # negative first bound, rank in bucket 2
        (0.25, {-1.0: 10, 0.5: 20, INF: 20}, -1.0),  # rank in a first bucket whose bound <= 0
        (0.5, {0.1: 0, 0.5: 60, 1.0: 50, INF: 100}, (0.1 + 0.4 * 50 / 60)),  # non-monotonic: envelope
        (0.5, {0.1: 0, INF: 0}, None),  # no observations: NaN
        (0.5, {0.1: 5, 1.0: 10}, None),  # no +Inf bucket: NaN
        (0.5, {INF: 10}, None),  # fewer than 2 buckets: NaN
    ],
)
def test_quantile_is_promqls_bucket_quantile(q, buckets, expected) -> None:
    got = quantile(q, buckets)
    assert got == expected if expected is None else got == pytest.approx(expected)


def test_quantile_refuses_out_of_range() -> None:
    with pytest.raises(ValueError, match="got 1.5"):
        quantile(1.5, {1.0: 1, INF: 1})


def test_view_rates_and_render_from_two_scrapes() -> None:
    metrics = RouterMetrics()
    metrics.watch_backend(lambda: {"members": {"prefill": 1, "decode": 2}, "in_flight": {"prefill": 1, "decode": 3}})
    metrics.set_decode_slots("decode-0", 3, 1)
    before = parse([metrics.exposition().decode()])
    cached = RequestInfo(disaggregated=True, kv_bytes=1, cached_tokens=4)
    for i, ttft in enumerate((0.02, 0.04, 0.2, 0.3)):
        metrics.observe_completed(RequestTiming(0.0, ttft, ttft + 0.9, 1.0, 10), 5, cached if i == 0 else None)
    metrics.observe_failed("timeout")
    metrics.observe_retry()
    after = parse([metrics.exposition().decode()])
    v = view(before, after, 2.0, routers=1)
    assert v.requests_per_s == 2.0 and v.tokens_per_s == 20.0 and v.prompt_tokens_per_s == 10.0
    assert v.failed_per_s == {"timeout": 0.5} and v.resumes_per_s == 0.5
    assert v.cached_tokens_per_s == 2.0  # 4 of the 20 prompt tokens came from a prefix cache
    assert v.members == {"prefill": 1, "decode": 2} and v.in_flight == {"prefill": 1, "decode": 3}
    assert v.slots == {"decode-0": (3, 4)}
    assert v.ttft["p50"] == pytest.approx(0.05)  # 2 of 4 in (0.025, 0.05]: the bound, from the deltas
    assert v.tpot["p50"] == pytest.approx(0.115)  # 4 of 4 in (0.08, 0.15]: halfway
    text = render(v, "http://r")
    assert "prefill 1  decode 2" in text and "decode-0" in text and "75%" in text and "timeout 0.50/s" in text
    assert "prefix cache hits 20% of prompt tokens" in text


def test_two_routers_sum_rates_and_do_not_double_members() -> None:
    a, b = RouterMetrics(), RouterMetrics()
    for m in (a, b):
        m.watch_backend(lambda: {"members": {"prefill": 2, "decode": 1}, "in_flight": {"decode": 1}})
        m.set_decode_slots("decode-0", 1, 3)
    before = parse([a.exposition().decode(), b.exposition().decode()])
    a.observe_completed(RequestTiming(0.0, 0.01, 0.02, 0.03, 2), 3, None)
    b.observe_completed(RequestTiming(0.0, 0.01, 0.02, 0.03, 2), 3, None)
    v = view(before, parse([a.exposition().decode(), b.exposition().decode()]), 1.0, routers=2)
    assert v.requests_per_s == 2.0 and v.members == {"prefill": 2, "decode": 1}
    assert v.in_flight == {"decode": 2} and v.slots == {"decode-0": (1, 4)}
