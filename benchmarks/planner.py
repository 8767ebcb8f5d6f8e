"""The planner over a simulated day of diurnal load, against a fixed allocation sized for the peak.

The day is simulated with the planner's event simulation (`planner.simulate`), whose service
times come from a hardware profile measured on this machine (`pdserve plan --profile`: 1 torch
thread per replica, as `pdserve local` gives each model process of 1P1D on 2 CPUs) and the
bundled model's shape. Requests arrive as a Poisson stream whose rate follows a day:

    rate(t) = peak · (trough + (1 − trough) · (1 − cos(2π t / day)) / 2)

Two deployments get the same requests:
- fixed: the (P, D) that `plan_replicas` picks for the peak rate, all day;
- planner: starts at the fixed counts, then every `interval` seconds `controller_step` gets what
  the routers and the broker would report (requests admitted over the last minute, their mean
  prompt/output lengths, TTFT/TPOT at the SLO quantile of the requests answered in the last
  interval, per-worker load) and its desired counts are applied: new replicas serve after
  `startup` seconds (pod start and model load), removed ones drain (finish their work) first.

Reported: replica-seconds of each (starting and draining replicas count), the share of
requests within both SLOs (TTFT and TPOT), p99s, and the planner's number of changes.
Targets: ≥ 30% fewer replica-seconds than fixed at ≥ 99% of requests within SLO.

    python benchmarks/planner.py [--profile FILE] [--peak 4] [--day-seconds 86400]
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "operator"), str(ROOT / "worker"), str(ROOT / "common")]

from pdserve_operator.planner import (  # noqa: E402
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
    load_profile,
    plan_replicas,
)
from pdserve_operator.planner.model_shape import SMOLLM2_135M  # noqa: E402
from pdserve_operator.planner.simulate import SimRequest, Simulation  # noqa: E402

DEFAULT_PROFILE = ROOT / "benchmarks" / "profiles" / "cpu-1t-2026-12-01.yaml"


def diurnal_arrivals(
    peak: float, trough: float, day: float, prompt: tuple[int, int], output: tuple[int, int], seed: int
) -> list[SimRequest]:
    """A non-homogeneous Poisson stream by thinning a rate-`peak` stream."""
    rng, t, out = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(peak)
        if t >= day:
            return out
        level = trough + (1 - trough) * (1 - math.cos(2 * math.pi * t / day)) / 2
        if rng.random() < level:
            out.append(SimRequest(t, rng.randint(*prompt), rng.randint(*output)))


def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def attainment(requests: list[SimRequest], slo: SLO) -> float:
    ok = 0
    for r in requests:
        ttft_ok = r.ttft is not None and r.ttft * 1e3 <= slo.ttft_ms
        tpot_ok = r.tpot is None or r.tpot * 1e3 <= slo.tpot_ms
        ok += ttft_ok and tpot_ok and r.done is not None
    return ok / len(requests)


def run_fixed(model: ServingModel, requests: list[SimRequest], p: int, d: int, day: float) -> Simulation:
    sim = Simulation(model, p, d)
    sim.submit(requests)
    sim.run()
    sim.horizon = max(day, sim.now)
    return sim


def run_planner(
    model: ServingModel,
    requests: list[SimRequest],
    config: ControllerConfig,
    start: tuple[int, int],
    day: float,
    interval: float,
    startup: float,
    rate_window: float,
) -> tuple[Simulation, list]:
    sim = Simulation(model, *start, startup_s=startup)
    sim.submit(requests)
    state, current = PlannerState(), start
    changes: list[tuple[float, str, int, int]] = []
    arrivals = [r.arrival for r in requests]
    first_arrival = 0  # index of the first arrival inside the rate window
    last_arrival = 0
    done_seen = 0
    q = config.workload.slo.quantile
    t = interval
    while t <= day:
        sim.run(t)
        while last_arrival < len(arrivals) and arrivals[last_arrival] <= t:
            last_arrival += 1
        while first_arrival < last_arrival and arrivals[first_arrival] <= t - rate_window:
            first_arrival += 1
        window = requests[first_arrival:last_arrival]
        answered = sim.completed[done_seen:]
        done_seen = len(sim.completed)
        ttfts = [r.ttft for r in answered if r.ttft is not None]
        tpots = [r.tpot for r in answered if r.tpot is not None]
        workers = tuple(WorkerLoad(wid, role, active, slots) for wid, role, active, slots in sim.loads())  # type: ignore[arg-type]
        ready = lambda role: sum(1 for w in workers if w.role == role)  # noqa: E731
        obs = Observation(
            prefill_replicas=current[0],
            decode_replicas=current[1],
            workers=workers,
            request_rate=len(window) / min(rate_window, t),
            prompt_tokens_mean=sum(r.prompt for r in window) / len(window) if window else None,
            output_tokens_mean=sum(r.output for r in window) / len(window) if window else None,
            ttft_s=quantile(ttfts, q) if ttfts else None,
            tpot_s=quantile(tpots, q) if tpots else None,
            samples=min(len(ttfts), len(tpots)),
            prefill_ready=ready("prefill"),
            decode_ready=ready("decode"),
        )
        result = controller_step(state, obs, t, config)
        state = result.state
        new = (result.prefill.desired, result.decode.desired)
        for role, old, value in (("prefill", current[0], new[0]), ("decode", current[1], new[1])):
            if value != old:
                changes.append((t, role, old, value))
                sim.scale_to(role, value)
        current = new
        t += interval
    sim.run()
    sim.horizon = max(day, sim.now)
    return sim, changes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default=str(DEFAULT_PROFILE), help="hardware profile (measured here)")
    parser.add_argument("--peak", type=float, default=4.0, help="peak requests/s")
    parser.add_argument("--trough", type=float, default=0.15, help="trough rate as a share of the peak")
    parser.add_argument("--day-seconds", type=float, default=86400.0)
    parser.add_argument("--prompt", default="32-512")
    parser.add_argument("--output", default="16-128")
    parser.add_argument("--ttft-ms", type=float, default=4000)
    parser.add_argument("--tpot-ms", type=float, default=200)
    parser.add_argument("--quantile", type=float, default=0.99)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=2304)
    parser.add_argument("--interval", type=float, default=15.0, help="seconds between planner steps")
    parser.add_argument("--startup", type=float, default=60.0, help="seconds before a new replica serves")
    parser.add_argument("--rate-window", type=float, default=60.0, help="seconds the admitted rate is averaged over")
    parser.add_argument("--up-window", type=float, default=30.0)
    parser.add_argument("--down-window", type=float, default=300.0)
    parser.add_argument("--max-replicas", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    profile = load_profile(args.profile)
    model = ServingModel(SMOLLM2_135M, profile, max_len=args.max_len, slots=args.slots)
    lo_p, hi_p = (int(x) for x in args.prompt.split("-"))
    lo_o, hi_o = (int(x) for x in args.output.split("-"))
    slo = SLO(ttft_ms=args.ttft_ms, tpot_ms=args.tpot_ms, quantile=args.quantile)
    workload = Workload(
        arrival_rate=args.peak,
        prompt_tokens=LengthDistribution(uniform=(lo_p, hi_p)),
        output_tokens=LengthDistribution(uniform=(lo_o, hi_o)),
        slo=slo,
    )
    bounds = Bounds(max_prefill=args.max_replicas, max_decode=args.max_replicas)
    peak_plan = plan_replicas(model, workload, bounds)
    if not peak_plan.meets_slo:
        print(f"the peak cannot be served within {args.max_replicas} replicas: {peak_plan.reason}", file=sys.stderr)
        return 2
    fixed = (peak_plan.prefill, peak_plan.decode)
    print(
        f"# planner benchmark {time.strftime('%Y-%m-%d %H:%M')}  profile {profile.name} "
        f"({(profile.measured or {}).get('date', 'published')})"
    )
    print(
        f"model {SMOLLM2_135M.name} {profile.dtype}; prompts {args.prompt}, outputs {args.output} tokens; "
        f"SLO p{args.quantile * 100:g}: TTFT {args.ttft_ms:g} ms, TPOT {args.tpot_ms:g} ms"
    )
    print(
        f"per replica: prefill of a mean prompt {model.prefill_service_seconds(round(workload.prompt_tokens.mean())):.2f} s, "
        f"decode step at batch 1/8 {model.decode_step_seconds(1, 300) * 1e3:.0f}/{model.decode_step_seconds(8, 2400) * 1e3:.0f} ms"
    )
    print(
        f"day: {args.day_seconds:g} s, rate {args.peak * args.trough:.2f}..{args.peak:.2f} req/s; fixed for the peak: "
        f"{fixed[0]}P {fixed[1]}D ({peak_plan.reason})",
        flush=True,
    )

    requests = diurnal_arrivals(args.peak, args.trough, args.day_seconds, (lo_p, hi_p), (lo_o, hi_o), args.seed)
    started = time.perf_counter()
    fixed_sim = run_fixed(model, requests, *fixed, args.day_seconds)
    fixed_att = attainment(requests, slo)
    fixed_ttft = quantile([r.ttft for r in requests], 0.99)
    fixed_tpot = quantile([r.tpot for r in requests if r.tpot], 0.99)
    for r in requests:
        r.first_token = r.done = None
    config = ControllerConfig(
        model=model, workload=workload, bounds=bounds, up_window_s=args.up_window, down_window_s=args.down_window
    )
    plan_sim, changes = run_planner(
        model, requests, config, fixed, args.day_seconds, args.interval, args.startup, args.rate_window
    )
    plan_att = attainment(requests, slo)
    plan_ttft = quantile([r.ttft for r in requests], 0.99)
    plan_tpot = quantile([r.tpot for r in requests if r.tpot], 0.99)
    elapsed = time.perf_counter() - started

    rs_fixed = fixed_sim.replica_seconds(until=fixed_sim.horizon)
    rs_plan = plan_sim.replica_seconds(until=plan_sim.horizon)
    print(f"\n{len(requests)} requests; simulated in {elapsed:.0f} s")
    print(
        f"{'':<9} {'replica-s':>10} {'prefill-s':>10} {'decode-s':>10} {'within SLO':>11} {'TTFT p99':>9} {'TPOT p99':>9} {'changes':>8}"
    )
    for name, sim, att, ttft, tpot, n in (
        ("fixed", fixed_sim, fixed_att, fixed_ttft, fixed_tpot, 0),
        ("planner", plan_sim, plan_att, plan_ttft, plan_tpot, len(changes)),
    ):
        print(
            f"{name:<9} {sim.replica_seconds(until=sim.horizon):>10.0f} "
            f"{sim.replica_seconds('prefill', sim.horizon):>10.0f} {sim.replica_seconds('decode', sim.horizon):>10.0f} "
            f"{att * 100:>10.2f}% {ttft:>8.2f}s {tpot * 1e3:>7.0f}ms {n:>8}"
        )
    saving = 1 - rs_plan / rs_fixed
    print(
        f"\nplanner saves {saving * 100:.1f}% replica-seconds (target >= 30%) at {plan_att * 100:.2f}% within SLO "
        f"(target >= 99%): {'met' if saving >= 0.30 and plan_att >= 0.99 else 'NOT met'}"
    )
    peak_counts = (
        max((c[3] for c in changes if c[1] == "prefill"), default=fixed[0]),
        max((c[3] for c in changes if c[1] == "decode"), default=fixed[1]),
    )
    low_counts = (
        min((c[3] for c in changes if c[1] == "prefill"), default=fixed[0]),
        min((c[3] for c in changes if c[1] == "decode"), default=fixed[1]),
    )
    print(f"planner ranged prefill {low_counts[0]}..{peak_counts[0]}, decode {low_counts[1]}..{peak_counts[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
