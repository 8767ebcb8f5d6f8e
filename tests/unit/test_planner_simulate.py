"""The discrete-event simulation: the request road, decode runs cut at step boundaries,
slot waits, replicas starting and draining, and agreement with the analytic prediction."""

from __future__ import annotations

import random
import statistics

import pytest

from pdserve_operator.planner import SLO, HardwareProfile, LengthDistribution, ServingModel, Workload, predict
from pdserve_operator.planner.model_shape import SMOLLM2_135M
from pdserve_operator.planner.simulate import SimRequest, Simulation, simulate_trace
from support.planner_profiles import TEST_CPU

# Everything but the fixed overhead is ~free: prefill = decode step = 1 s, whatever the batch.
CLOCK = HardwareProfile(
    name="clock",
    device="cpu",
    dtype="float32",
    matmul_flops=1e30,
    memory_bandwidth=1e30,
    link_bandwidth=1e30,
    step_overhead_s=1.0,
    overlap_compute_memory=True,
    overlap_transfer=True,
)
CPU = TEST_CPU.model_copy(update={"request_overhead_s": 2e-3})


def test_a_request_arriving_mid_run_joins_at_the_next_step_boundary():
    model = ServingModel(SMOLLM2_135M, CLOCK)
    a, b = SimRequest(0.0, 10, 5), SimRequest(0.2, 10, 3)
    simulate_trace(model, [a, b], prefill=2, decode=1)
    assert a.first_token == pytest.approx(1.0) and a.done == pytest.approx(5.0)  # 4 steps of 1 s
    # b's KV is ready at 1.2, mid-step: its first token goes out at the boundary, 2.0.
    assert b.first_token == pytest.approx(2.0) and b.done == pytest.approx(4.0)
    assert a.tpot == pytest.approx(1.0) and b.tpot == pytest.approx(1.0)


def test_prefill_is_one_prompt_at_a_time_and_goes_to_the_shortest_queue():
    model = ServingModel(SMOLLM2_135M, CLOCK)
    reqs = [SimRequest(0.0, 10, 1) for _ in range(5)]
    simulate_trace(model, reqs, prefill=2, decode=1)
    assert sorted(r.first_token for r in reqs) == pytest.approx([1.0, 1.0, 2.0, 2.0, 3.0])


def test_a_full_decode_makes_requests_wait_for_a_slot():
    model = ServingModel(SMOLLM2_135M, CLOCK, slots=1)
    a, b = SimRequest(0.0, 10, 3), SimRequest(0.0, 10, 3)
    sim = Simulation(model, 2, 1)
    sim.submit([a, b])
    sim.run()
    # b holds no slot until a is done (t=3): its prefill runs 3..4.
    assert a.done == pytest.approx(3.0) and b.first_token == pytest.approx(4.0) and b.done == pytest.approx(6.0)
    assert sim.decodes[0].reserved == 0


def test_new_replicas_serve_only_once_started_and_draining_ones_finish_their_work():
    model = ServingModel(SMOLLM2_135M, CLOCK)
    sim = Simulation(model, 1, 1, startup_s=5.0)
    sim.scale_to("prefill", 2)
    reqs = [SimRequest(0.0, 10, 1), SimRequest(0.0, 10, 1)]
    sim.submit(reqs)
    sim.run()
    assert [r.first_token for r in reqs] == pytest.approx([1.0, 2.0])  # the new prefill was still starting
    later = [SimRequest(10.0, 10, 1), SimRequest(10.0, 10, 1)]
    sim.submit(later)
    sim.run(10.0)
    sim.scale_to("prefill", 1)  # one drains: it keeps the prompt it was given
    sim.run()
    assert all(r.done is not None for r in later)
    assert sorted(r.first_token for r in later) == pytest.approx([11.0, 11.0])
    drained = [p for p in sim.prefills if p.removed is not None]
    assert len(drained) == 1 and drained[0].removed == pytest.approx(11.0)
    assert sim.replica_seconds("prefill", until=20.0) == pytest.approx(20.0 + (11.0 - 0.0))


def test_every_request_finishes_and_every_slot_is_returned():
    model = ServingModel(SMOLLM2_135M, CPU, slots=6)
    rng = random.Random(4)
    t, reqs = 0.0, []
    for _ in range(800):
        t += rng.expovariate(2.0)
        reqs.append(SimRequest(t, rng.randint(16, 900), rng.randint(1, 120)))
    sim = Simulation(model, 2, 2)
    sim.submit(reqs)
    sim.run()
    assert all(r.done is not None and r.first_token is not None and r.done >= r.first_token > r.arrival for r in reqs)
    assert all(d.reserved == 0 and not d.active and not d.pending for d in sim.decodes)
    assert not sim.waiting


def test_simulation_and_prediction_agree_on_means():
    workload = Workload(
        arrival_rate=2.0,
        prompt_tokens=LengthDistribution(uniform=(128, 1024)),
        output_tokens=LengthDistribution(uniform=(32, 160)),
        slo=SLO(quantile=0.99),
    )
    model = ServingModel(SMOLLM2_135M, CPU)
    rng = random.Random(11)
    t, reqs = 0.0, []
    for _ in range(20_000):
        t += rng.expovariate(2.0)
        reqs.append(SimRequest(t, rng.randint(128, 1024), rng.randint(32, 160)))
    simulate_trace(model, reqs, 2, 2)
    pred = predict(model, workload, 2, 2)
    ttft = [r.ttft for r in reqs]
    tpot = [r.tpot for r in reqs if r.tpot]
    assert statistics.mean(ttft) == pytest.approx(pred.ttft_mean_s, rel=0.10)
    assert statistics.median(ttft) == pytest.approx(pred.ttft_p50_s, rel=0.10)
    assert statistics.mean(tpot) == pytest.approx(pred.tpot_mean_s, rel=0.10)
    # The quantile predictions are upper bounds, not far above.
    ttft_99 = sorted(ttft)[int(0.99 * len(ttft))]
    tpot_99 = sorted(tpot)[int(0.99 * len(tpot))]
    assert 0.9 * ttft_99 <= pred.ttft_q_s <= 1.5 * ttft_99
    assert tpot_99 <= pred.tpot_q_s <= 1.5 * tpot_99
