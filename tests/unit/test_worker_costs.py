"""A worker's reported costs (serving/costs.py): the prefill rate is an EWMA over passes, the
step time is taken over the window since the last report, and nothing unmeasured moves either."""

from __future__ import annotations

import pytest

from pdserve_worker.serving.costs import EWMA_WEIGHT, CostMeter


def test_the_prefill_rate_follows_passes_and_ignores_empty_ones() -> None:
    meter = CostMeter()
    meter.prefilled(0, 1.0)
    meter.prefilled(100, 0.0)
    assert meter.prefill_tokens_per_s == 0.0  # nothing measured yet
    meter.prefilled(1000, 1.0)
    assert meter.prefill_tokens_per_s == 1000.0  # the first pass is taken whole
    meter.prefilled(2000, 1.0)
    assert meter.prefill_tokens_per_s == pytest.approx((1 - EWMA_WEIGHT) * 1000 + EWMA_WEIGHT * 2000)


def test_step_time_is_over_the_window_since_the_last_report() -> None:
    meter = CostMeter()
    assert meter.steps(0, 0.0) == 0.0
    assert meter.steps(10, 0.5) == pytest.approx(0.05)
    assert meter.steps(30, 0.7) == pytest.approx(0.01)  # 20 steps in 0.2 s since the last call
    assert meter.steps(30, 0.7) == pytest.approx(0.01)  # no step since: the last figure stays
