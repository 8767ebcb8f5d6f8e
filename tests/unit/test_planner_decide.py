"""The replica decision: the chosen (P, D) meets the SLOs and nothing cheaper in the bounds does.

The oracle is the queueing model itself (`predict`, whose formulas test_planner_queueing.py
checks against exact solutions and simulations): every allowed pair of a small grid is
evaluated by brute force and compared with what `plan_replicas` chose. The end-to-end check
replays Poisson traffic through the discrete-event simulation at the chosen counts.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from pdserve_operator.planner import (
    SLO,
    Bounds,
    LengthDistribution,
    ServingModel,
    Workload,
    plan_replicas,
    predict,
)
from pdserve_operator.planner.decide import smallest_pair
from pdserve_operator.planner.model_shape import SMOLLM2_135M
from pdserve_operator.planner.simulate import SimRequest, simulate_trace
from support.planner_profiles import TEST_CPU

CPU = TEST_CPU
MODEL = ServingModel(SMOLLM2_135M, CPU, max_len=2304, slots=24)


def brute_force(model: ServingModel, workload: Workload, bounds: Bounds) -> tuple[int, int] | None:
    best = None
    for p in range(bounds.min_prefill, bounds.max_prefill + 1):
        for d in range(bounds.min_decode, bounds.max_decode + 1):
            if not bounds.in_band(p, d):
                continue
            pred = predict(model, workload, p, d)
            if pred.meets_ttft(workload.slo) and pred.meets_tpot(workload.slo):
                key = (bounds.cost(p, d), p + d, p)
                if best is None or key < best[0]:
                    best = (key, (p, d))
    return None if best is None else best[1]


lengths = st.one_of(
    st.builds(lambda n: LengthDistribution(fixed=n), st.integers(16, 1500)),
    st.builds(lambda lo, w: LengthDistribution(uniform=(lo, lo + w)), st.integers(16, 800), st.integers(0, 1200)),
)
outputs = st.one_of(
    st.builds(lambda n: LengthDistribution(fixed=n), st.integers(2, 300)),
    st.builds(lambda lo, w: LengthDistribution(uniform=(lo, lo + w)), st.integers(2, 100), st.integers(0, 200)),
)


@st.composite
def bounds_st(draw) -> Bounds:
    min_p, min_d = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    max_p, max_d = draw(st.integers(min_p, 5)), draw(st.integers(min_d, 5))
    lo = draw(st.one_of(st.none(), st.sampled_from([0.25, 0.5, 1.0])))
    hi = draw(st.one_of(st.none(), st.sampled_from([0.5, 1.0, 2.0, 3.0])))
    assume(lo is None or hi is None or lo <= hi)
    try:
        return Bounds(
            min_prefill=min_p, max_prefill=max_p, min_decode=min_d, max_decode=max_d, min_ratio=lo, max_ratio=hi
        )
    except ValueError:
        assume(False)
        raise


@given(
    rate=st.floats(0.05, 8.0),
    prompt=lengths,
    output=outputs,
    ttft=st.floats(200, 8000),
    tpot=st.floats(25, 200),
    quantile=st.sampled_from([0.5, 0.9, 0.99]),
    bounds=bounds_st(),
)
@example(  # the p50 sits on a step of the TTFT CDF: the plan's check and its prediction must agree there
    rate=0.0625,
    prompt=LengthDistribution(uniform=(59, 360)),
    output=LengthDistribution(fixed=2),
    ttft=200.0,
    tpot=29.0,
    quantile=0.5,
    bounds=Bounds(min_prefill=1, max_prefill=5, min_decode=1, max_decode=1),
)
@settings(max_examples=80, deadline=None)
def test_plan_is_the_cheapest_pair_that_meets_the_slo(rate, prompt, output, ttft, tpot, quantile, bounds):
    workload = Workload(
        arrival_rate=rate,
        prompt_tokens=prompt,
        output_tokens=output,
        slo=SLO(ttft_ms=ttft, tpot_ms=tpot, quantile=quantile),
    )
    plan = plan_replicas(MODEL, workload, bounds)
    expected = brute_force(MODEL, workload, bounds)
    assert bounds.contains(plan.prefill, plan.decode)
    if expected is None:
        assert not plan.meets_slo and "not reachable" in plan.reason
    else:
        assert plan.meets_slo
        assert (plan.prefill, plan.decode) == expected
        assert plan.prediction.meets_ttft(workload.slo) and plan.prediction.meets_tpot(workload.slo)


@given(rate=st.floats(0.05, 6.0), factor=st.floats(1.0, 3.0), bounds=bounds_st())
@settings(max_examples=30, deadline=None)
def test_more_load_never_costs_less(rate, factor, bounds):
    base = Workload(
        arrival_rate=rate,
        prompt_tokens=LengthDistribution(uniform=(64, 1024)),
        output_tokens=LengthDistribution(uniform=(16, 128)),
        slo=SLO(ttft_ms=2500, tpot_ms=90),
    )
    low, high = plan_replicas(MODEL, base, bounds), plan_replicas(MODEL, base.with_rate(rate * factor), bounds)
    if low.meets_slo and high.meets_slo:
        assert bounds.cost(high.prefill, high.decode) >= bounds.cost(low.prefill, low.decode)


@given(data=st.data(), bounds=bounds_st())
@settings(max_examples=100, deadline=None)
def test_smallest_pair_on_monotone_predicates(data, bounds):
    """Any upward-closed feasible set: the search returns its cheapest allowed member."""
    need_p, need_d = data.draw(st.integers(1, 7)), data.draw(st.integers(1, 7))
    extra = data.draw(st.integers(0, 4))  # and P + D must reach need_p + need_d + extra

    def feasible(p: int, d: int) -> bool:
        return p >= need_p and d >= need_d and p + d >= need_p + need_d + extra

    got = smallest_pair(feasible, bounds)
    allowed = [(p, d) for p in range(1, 8) for d in range(1, 8) if bounds.contains(p, d) and feasible(p, d)]
    if not allowed:
        assert got is None
    else:
        assert got in allowed
        assert bounds.cost(*got) == min(bounds.cost(*pd) for pd in allowed)


def test_band_and_bounds_are_validated_and_clamped():
    with pytest.raises(ValueError, match="1 <= min <= max"):
        Bounds(min_prefill=3, max_prefill=2)
    with pytest.raises(ValueError, match="exceeds max_ratio"):
        Bounds(min_ratio=2, max_ratio=1)
    with pytest.raises(ValueError, match="has a P:D ratio within"):
        Bounds(max_prefill=1, min_decode=4, max_decode=8, min_ratio=0.5)
    band = Bounds(max_prefill=8, max_decode=8, min_ratio=0.5, max_ratio=1.0)
    assert band.clamp(1, 6) == (3, 6)  # the short role is raised
    assert band.clamp(5, 2) == (5, 5)
    assert band.clamp(0, 0) == (1, 1)
    assert band.clamp(20, 20) == (8, 8)


def test_the_band_can_set_a_count_and_the_reason_says_so():
    workload = Workload(
        arrival_rate=1.0,
        prompt_tokens=LengthDistribution(fixed=128),
        output_tokens=LengthDistribution(fixed=400),
        slo=SLO(ttft_ms=5000, tpot_ms=60),
    )
    free = plan_replicas(MODEL, workload, Bounds(max_prefill=8, max_decode=8))
    banded = plan_replicas(MODEL, workload, Bounds(max_prefill=8, max_decode=8, min_ratio=1.0))
    assert (free.prefill, free.decode) == (1, 3)  # decode-heavy: long answers
    assert (banded.prefill, banded.decode) == (3, 3)  # P:D >= 1 raises the prefills
    assert "prefill 3 set by the P:D band" in banded.reason


def poisson_trace(rate: float, n: int, prompt: tuple[int, int], output: tuple[int, int], seed: int) -> list[SimRequest]:
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(SimRequest(t, rng.randint(*prompt), rng.randint(*output)))
    return out


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def test_chosen_counts_meet_the_slo_in_simulation_and_one_prefill_fewer_does_not():
    workload = Workload(
        arrival_rate=3.0,
        prompt_tokens=LengthDistribution(uniform=(128, 1024)),
        output_tokens=LengthDistribution(uniform=(32, 160)),
        slo=SLO(ttft_ms=2000, tpot_ms=90, quantile=0.9),
    )
    plan = plan_replicas(MODEL, workload, Bounds(max_prefill=12, max_decode=12))
    assert plan.meets_slo and plan.prefill >= 2
    trace = poisson_trace(3.0, 6000, (128, 1024), (32, 160), seed=3)
    done = simulate_trace(MODEL, trace, plan.prefill, plan.decode)
    assert quantile([r.ttft for r in done], 0.9) <= 2.0
    assert quantile([r.tpot for r in done if r.tpot], 0.9) <= 0.090
    for r in trace:
        r.first_token = r.done = None
    fewer = simulate_trace(MODEL, trace, plan.prefill - 1, plan.decode)
    assert quantile([r.ttft for r in fewer], 0.9) > 2.0
