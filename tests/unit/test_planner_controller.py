"""The autoscaler step: up fast, down slow, at most one change per window under oscillation,
always within bounds and the P:D band; corrections from observed TTFT/TPOT."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve_operator.planner import (
    SLO,
    Bounds,
    ControllerConfig,
    LengthDistribution,
    Observation,
    PlannerState,
    ServingModel,
    WorkerLoad,
    Workload,
    controller_step,
    plan_replicas,
)
from pdserve_operator.planner.model_shape import SMOLLM2_135M
from support.planner_profiles import TEST_CPU

CPU = TEST_CPU
MODEL = ServingModel(SMOLLM2_135M, CPU, max_len=2304, slots=24)
WORKLOAD = Workload(
    arrival_rate=0,
    prompt_tokens=LengthDistribution(uniform=(128, 1024)),
    output_tokens=LengthDistribution(uniform=(32, 160)),
    slo=SLO(ttft_ms=2000, tpot_ms=90),
)
BOUNDS = Bounds(min_prefill=1, max_prefill=12, min_decode=1, max_decode=12, min_ratio=0.5, max_ratio=3.0)


def config(**kw) -> ControllerConfig:
    return ControllerConfig(
        model=MODEL, workload=WORKLOAD, bounds=BOUNDS, **{"up_window_s": 30, "down_window_s": 300, **kw}
    )


def needed(rate: float) -> tuple[int, int]:
    plan = plan_replicas(MODEL, WORKLOAD.with_rate(rate), BOUNDS)
    return plan.prefill, plan.decode


class Loop:
    """Feeds a rate function to the controller every `interval` seconds and applies its answer."""

    def __init__(self, cfg: ControllerConfig, start: tuple[int, int] = (1, 1), interval: float = 10.0) -> None:
        self.cfg, self.state, self.current, self.interval = cfg, PlannerState(), start, interval
        self.changes: list[tuple[float, str, int, int]] = []  # (time, role, old, new)
        self.t = 0.0

    def run(self, rate_at, until: float) -> None:
        while self.t <= until:
            obs = Observation(
                prefill_replicas=self.current[0], decode_replicas=self.current[1], request_rate=rate_at(self.t)
            )
            result = controller_step(self.state, obs, self.t, self.cfg)
            self.state = result.state
            new = (result.prefill.desired, result.decode.desired)
            assert self.cfg.bounds.contains(*new), (new, result.prefill.reason)
            for role, old, value in (("prefill", self.current[0], new[0]), ("decode", self.current[1], new[1])):
                if old != value:
                    self.changes.append((self.t, role, old, value))
            self.current = new
            self.t += self.interval


def test_a_load_step_scales_both_roles_up_within_the_up_window():
    low, high = 0.5, 4.0
    assert needed(high)[0] > needed(low)[0] and needed(high)[1] > needed(low)[1]
    loop = Loop(config(), start=needed(low))
    loop.run(lambda t: low if t < 400 else high, until=400 + 30)
    assert loop.current == needed(high)
    ups = [c for c in loop.changes if c[0] >= 400]
    assert ups and all(400 + 30 - 10 <= t <= 400 + 30 for t, *_ in ups)  # the first step whose window is all high


def test_up_window_zero_scales_up_at_the_first_high_observation():
    loop = Loop(config(up_window_s=0), start=needed(0.5))
    loop.run(lambda t: 0.5 if t < 100 else 4.0, until=100)
    assert loop.current == needed(4.0)


def test_a_load_drop_scales_down_only_after_the_down_window_in_one_step():
    high, low = 4.0, 0.5
    loop = Loop(config(), start=needed(high))
    loop.run(lambda t: high if t < 1000 else low, until=2000)
    downs = [c for c in loop.changes if c[3] < c[2]]
    assert loop.current == needed(low)
    # The last high recommendation was made at t=990: it holds until 990 + 300.
    assert downs and all(t >= 990 + 300 for t, *_ in downs)
    assert len({role for _, role, _, _ in downs}) == len(downs)  # one step per role


def test_a_fresh_controller_does_not_scale_down_before_watching_a_whole_window():
    loop = Loop(config(), start=(8, 8))
    loop.run(lambda t: 0.3, until=290)
    assert loop.current == (8, 8) and not loop.changes
    loop.run(lambda t: 0.3, until=310)
    assert loop.current == needed(0.3)


@given(
    half_period=st.sampled_from([20.0, 40.0, 60.0, 100.0, 140.0]),
    low=st.floats(0.2, 1.0),
    high=st.floats(2.0, 5.0),
    up_window=st.sampled_from([0.0, 10.0, 30.0]),
)
@settings(max_examples=15, deadline=None)
def test_load_oscillating_faster_than_the_window_makes_at_most_one_change_per_window(half_period, low, high, up_window):
    window = 300.0
    loop = Loop(config(up_window_s=up_window, down_window_s=window), start=needed(low))
    loop.run(lambda t: high if int(t // half_period) % 2 else low, until=1500)  # five windows
    for role in ("prefill", "decode"):
        times = [t for t, r, _, _ in loop.changes if r == role]
        for a, b in zip(times, times[1:]):
            assert b - a >= window, (role, loop.changes)
        # In fact nothing comes down while the load keeps returning within the window.
        assert all(new > old for _, r, old, new in loop.changes if r == role)


@given(
    rates=st.lists(st.floats(0.0, 8.0), min_size=5, max_size=40),
    start=st.tuples(st.integers(1, 12), st.integers(1, 12)),
)
@settings(max_examples=40, deadline=None)
def test_every_decision_is_within_bounds_and_band(rates, start):
    loop = Loop(config(up_window_s=0, down_window_s=60), start=start)
    loop.run(lambda t: rates[min(len(rates) - 1, int(t // 10))], until=10 * len(rates))  # Loop asserts contains()


def test_no_load_signal_holds_and_says_why():
    obs = Observation(prefill_replicas=3, decode_replicas=4)
    result = controller_step(PlannerState(), obs, 0.0, config())
    assert (result.prefill.desired, result.decode.desired) == (3, 4)
    assert "no load signal" in result.prefill.reason and result.plan is None


def test_rate_falls_back_to_littles_law_on_decode_slots():
    """Without the routers' rate: running sequences / (steps per request · step time)."""
    workers = tuple(WorkerLoad(f"d{i}", "decode", active_requests=10, slots_used=10, slots_total=24) for i in range(2))
    workers += (WorkerLoad("p0", "prefill", active_requests=2),)
    obs = Observation(prefill_replicas=1, decode_replicas=2, workers=workers, tpot_s=0.05)
    result = controller_step(PlannerState(), obs, 0.0, config())
    steps = sum((m - 1) * p for m, p in WORKLOAD.output_tokens.points())
    assert result.rate == pytest.approx(20 / (steps * 0.05))


def test_observed_slowness_corrects_the_model_and_asks_for_more():
    base = Observation(prefill_replicas=2, decode_replicas=2, request_rate=2.0)
    plain = controller_step(PlannerState(), base, 0.0, config(up_window_s=0))
    # Routers saw TTFT 3x what the model predicts at the current counts: plan as if 3x tighter.
    from pdserve_operator.planner import predict

    predicted = predict(MODEL, WORKLOAD.with_rate(2.0), 2, 2)
    slow = Observation(
        prefill_replicas=2,
        decode_replicas=2,
        request_rate=2.0,
        ttft_s=3 * predicted.ttft_q_s,
        tpot_s=predicted.tpot_q_s,
        samples=100,
    )
    state = PlannerState()
    for i in range(10):  # the EWMA converges toward the observed ratio
        result = controller_step(state, slow, float(i), config(up_window_s=0))
        state = result.state
    assert state.ttft_correction == pytest.approx(3.0, rel=0.1)
    assert state.tpot_correction == pytest.approx(1.0, abs=0.05)
    assert result.plan.prefill > plain.plan.prefill
    assert any("corrected" in n for n in result.notes)
    # Too few samples, or replicas still starting: no correction.
    few = controller_step(PlannerState(), Observation(**{**slow.__dict__, "samples": 3}), 0.0, config())
    assert few.state.ttft_correction == 1.0
    starting = controller_step(PlannerState(), Observation(**{**slow.__dict__, "prefill_ready": 1}), 0.0, config())
    assert starting.state.ttft_correction == 1.0


def test_unreachable_slo_goes_to_the_bounds_and_says_so():
    tight = ControllerConfig(
        model=MODEL,
        workload=WORKLOAD.model_copy(update={"slo": SLO(ttft_ms=1, tpot_ms=1)}),
        bounds=BOUNDS,
        up_window_s=0,
    )
    result = controller_step(
        PlannerState(), Observation(prefill_replicas=1, decode_replicas=1, request_rate=1.0), 0.0, tight
    )
    assert (result.prefill.desired, result.decode.desired) == (12, 12)
    assert any("not reachable" in n for n in result.notes)


def test_config_is_validated():
    with pytest.raises(ValueError, match="windows"):
        config(up_window_s=-1)
    with pytest.raises(ValueError, match="headroom"):
        config(headroom=0.5)
    with pytest.raises(ValueError, match="correction_limits"):
        config(correction_limits=(2.0, 3.0))
