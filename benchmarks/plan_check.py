"""`pdserve plan` against measurement: predicted TTFT/TPOT for serve.py's trace vs measured medians.

1. Measures a hardware profile on this machine (`pdserve plan --profile`'s probes, with the
   torch threads `pdserve local` gives each model process) right before each configuration
   is served. The model's overhead terms come from that profile, never from serving results.
   Its compute figures are CPU time per thread: the speed of a core that is the worker's.
2. Predicts the median TTFT and TPOT of `benchmarks/serve.py`'s request trace (same seed,
   same arguments) at 1 prefill + 1 decode and 1 prefill + 2 decode by replaying the trace
   through the planner's event simulation (12 requests are a transient, not the steady state
   the analytic M/G/c prediction describes; the analytic figures for a Poisson stream with
   the trace's length mix are printed beside it).
3. Runs the configurations as serve.py does (real `pdserve local` processes, the same client)
   and reads, from /proc/PID/task/*/schedstat of the prefill and decode processes, how long
   their threads were runnable but waiting for a CPU. On a shared host that share is not the
   model's business, so two predictions are shown: for dedicated cores (the profile as is),
   and for the CPU share each role's processes actually got (the profile's speeds × that
   share, prefill and decode apart). The second uses the run's scheduler statistics, never
   its latencies. Both medians are serve.py's percentile (an element of the 12, not an
   interpolation), and the per-request TTFTs are printed too.
4. The engine alone (prefill of 128/1024/2048 tokens, decode steps at batch 1 and 8) in this
   process against the model's service times, in CPU time and in wall time.

    python benchmarks/plan_check.py [--configs pd1,pd2] [--no-serve] [--no-components]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [
    str(ROOT / "benchmarks"),
    str(ROOT / "worker"),
    str(ROOT / "operator"),
    str(ROOT / "common"),
    str(ROOT / "proto"),
]

import serve  # noqa: E402  (benchmarks/serve.py: the trace, the client, the summary)
from pdserve_operator.planner import (  # noqa: E402
    SLO,
    HardwareProfile,
    LengthDistribution,
    ServingModel,
    Workload,
    load_profile,
    predict,
)
from pdserve_operator.planner.model_shape import SMOLLM2_135M  # noqa: E402
from pdserve_operator.planner.simulate import SimRequest, simulate_trace  # noqa: E402


def slowed(profile: HardwareProfile, share: float) -> HardwareProfile:
    """The profile of a core of which only `share` is available: every compute cost / share."""
    return profile.with_overrides(
        name=f"{profile.name}@{share:.2f}",
        matmul_flops=profile.matmul_flops * share,
        attention_flops=(profile.attention_flops or profile.matmul_flops) * share,
        memory_bandwidth=profile.memory_bandwidth * share,
        attention_overhead_s=profile.attention_overhead_s / share,
        step_overhead_s=profile.step_overhead_s / share,
        layer_overhead_s=profile.layer_overhead_s / share,
        sequence_overhead_s=profile.sequence_overhead_s / share,
    )


def schedstat(pids: list[int]) -> tuple[int, int]:
    """(ns on a CPU, ns runnable but waiting) summed over every thread of `pids`."""
    run = wait = 0
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                fields = (task / "schedstat").read_text().split()
            except OSError:
                continue
            run += int(fields[0])
            wait += int(fields[1])
    return run, wait


def predict_trace(model: ServingModel, trace, output_tokens: int, p: int, d: int) -> tuple[float, float, list]:
    """Median TTFT and TPOT of the replayed trace, by serve.py's own percentile (an element of
    the sample, not an interpolation: with 12 bimodal TTFTs the two differ by seconds)."""
    replay = simulate_trace(model, [SimRequest(r.at, r.prompt_tokens, output_tokens) for r in trace], p, d)
    return serve.pct([r.ttft for r in replay], 50), serve.pct([r.tpot for r in replay if r.tpot], 50), replay


def serve_measured(name: str, dtype: str, args: argparse.Namespace, trace) -> tuple[dict, dict[str, float], list]:
    """serve.run_config's run, plus the CPU share its prefill and its decode processes got."""
    from pdserve_worker.cli.local_deployment import LocalDeployment
    from pdserve_worker.cli.local_plan import LocalPlan

    plan = LocalPlan(port=0, dtype=dtype, slots=args.slots, max_len=args.max_len, threads=0, **serve.CONFIGS[name])
    print(f"[{name}] serving the trace ...", file=sys.stderr, flush=True)
    with LocalDeployment(plan, progress=None) as deployment:
        url = deployment.start(timeout_s=300)
        pids = {
            role: [c.pid for c in deployment.children if c.role == role and c.pid] for role in ("prefill", "decode")
        }
        before = {role: schedstat(p) for role, p in pids.items()}
        results, wall = asyncio.run(serve.drive(url, trace, args.output_tokens))
        after = {role: schedstat(p) for role, p in pids.items()}
    for r in results:
        if r.error:
            print(f"[{name}] request failed: {r.error}", file=sys.stderr)
    shares = {}
    for role in pids:
        ran, waited = after[role][0] - before[role][0], after[role][1] - before[role][1]
        shares[role] = ran / max(1, ran + waited)
    return serve.summarize(name, results, wall), shares, results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="pd1,pd2")
    parser.add_argument("--profile", default=None, help="a profile file to use instead of measuring one per config")
    parser.add_argument("--save-profile", default=None, help="where to write the profiles measured (one per config)")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--rate", type=float, default=0.4)
    parser.add_argument("--long-fraction", type=float, default=0.35)
    parser.add_argument("--output-tokens", type=int, default=24)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=2304)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-serve", action="store_true", help="predict only")
    parser.add_argument("--no-components", action="store_true", help="skip the engine-alone comparison")
    args = parser.parse_args()

    from pdserve_worker.cli.local_deployment import auto_dtype
    from pdserve_worker.cli.local_plan import LocalPlan
    from pdserve_worker.model.loading.loader import model_folder
    from pdserve_worker.model.tokenizer import Tokenizer

    dtype = auto_dtype()
    configs = args.configs.split(",")
    threads = {name: LocalPlan(port=0, **serve.CONFIGS[name]).threads_per_process() for name in configs}
    cpus = len(os.sched_getaffinity(0))
    print(
        f"# plan_check {time.strftime('%Y-%m-%d %H:%M')}  {platform.machine()} {cpus} CPUs  dtype={dtype}  "
        f"threads per model process {threads}  load {os.getloadavg()[0]:.2f}",
        flush=True,
    )

    def get_profile(name: str) -> HardwareProfile:
        if args.profile:
            profile = load_profile(args.profile)
        else:
            from pdserve_worker.cli.hw_profile import measure

            print(f"[{name}] measuring the profile (load {os.getloadavg()[0]:.2f}) ...", file=sys.stderr, flush=True)
            profile = measure(
                SMOLLM2_135M,
                dtype,
                threads[name],
                progress=lambda line: print(line, file=sys.stderr, flush=True),
                name=f"here-{dtype}",
            )
            if args.save_profile:
                profile.dump(Path(args.save_profile).with_suffix(f".{name}.yaml"))
        print(
            f"[{name}] profile: matmul {profile.matmul_flops / 1e9:.1f} GFLOP/s, attention "
            f"{(profile.attention_flops or 0) / 1e9:.1f} GFLOP/s + {profile.attention_overhead_s * 1e3:.2f} ms/layer, "
            f"read {profile.memory_bandwidth / 1e9:.2f} GB/s, layer overhead {profile.layer_overhead_s * 1e6:.0f} us, "
            f"sequence overhead {profile.sequence_overhead_s * 1e6:.0f} us, link {profile.link_bandwidth / 1e9:.2f} GB/s",
            flush=True,
        )
        return profile

    folder, _ = model_folder(None, dtype)
    tokenizer = Tokenizer.from_dir(folder)
    trace = serve.make_trace(
        args.requests, args.rate, args.long_fraction, (32, 256), (1024, 2048), tokenizer, args.seed
    )
    workload = Workload(
        arrival_rate=args.rate,
        prompt_tokens=LengthDistribution.of([r.prompt_tokens for r in trace]),
        output_tokens=LengthDistribution(fixed=args.output_tokens),
        slo=SLO(quantile=0.5),
    )

    rows, last_profile = [], None
    for name in configs:
        last_profile = profile = get_profile(name)
        model = ServingModel(SMOLLM2_135M, profile, max_len=args.max_len, slots=args.slots)
        p, d = serve.CONFIGS[name]["prefill"], serve.CONFIGS[name]["decode"]
        analytic = predict(model, workload, p, d)
        row = {"config": name, "P": p, "D": d, "analytic": analytic}
        row["pred_ttft"], row["pred_tpot"], _ = predict_trace(model, trace, args.output_tokens, p, d)
        if not args.no_serve:
            measured, shares, results = serve_measured(name, dtype, args, trace)
            row.update(ttft=measured["ttft_p50"], tpot=measured["tpot_p50"], failed=measured["failed"], shares=shares)
            shared = ServingModel(
                SMOLLM2_135M,
                slowed(profile, shares["prefill"]),
                max_len=args.max_len,
                slots=args.slots,
                decode_profile=slowed(profile, shares["decode"]),
            )
            row["adj_ttft"], row["adj_tpot"], replay = predict_trace(shared, trace, args.output_tokens, p, d)
            print(f"[{name}] per request (prompt tokens: TTFT measured / predicted at share):", flush=True)
            print(
                "   "
                + ", ".join(
                    f"{r.request.prompt_tokens}: {r.ttft:.1f}/{s.ttft:.1f}s"
                    for r, s in zip(results, replay)
                    if r.ttft is not None
                ),
                flush=True,
            )
        rows.append(row)

    def ratio(a: float | None, b: float | None) -> str:
        return f"{a / b:.2f}" if a and b else "-"

    print("\npredicted (replay of the trace) vs measured medians; ratio = predicted / measured")
    print(
        f"{'config':<7} {'CPU P/D':>9} {'TTFT meas':>9} {'dedicated':>10} {'ratio':>6} {'at share':>9} {'ratio':>6} "
        f"{'TPOT meas':>9} {'dedicated':>10} {'ratio':>6} {'at share':>9} {'ratio':>6}"
    )
    for r in rows:
        shares = r.get("shares", {})
        share_text = f"{shares['prefill']:.2f}/{shares['decode']:.2f}" if shares else "-"
        print(
            f"{r['config']:<7} {share_text:>9} {r.get('ttft', float('nan')):>8.2f}s "
            f"{r['pred_ttft']:>9.2f}s {ratio(r['pred_ttft'], r.get('ttft')):>6} {r.get('adj_ttft', float('nan')):>8.2f}s "
            f"{ratio(r.get('adj_ttft'), r.get('ttft')):>6} {r.get('tpot', float('nan')) * 1e3:>7.0f}ms "
            f"{r['pred_tpot'] * 1e3:>8.0f}ms {ratio(r['pred_tpot'], r.get('tpot')):>6} "
            f"{r.get('adj_tpot', float('nan')) * 1e3:>7.0f}ms {ratio(r.get('adj_tpot'), r.get('tpot')):>6}"
        )
    for r in rows:
        a = r["analytic"]
        print(
            f"analytic, Poisson at {args.rate}/s with the trace's lengths, {r['config']}: TTFT p50 "
            f"{a.ttft_p50_s:.2f}s, TPOT mean {a.tpot_mean_s * 1e3:.0f}ms, prefill utilisation {a.prefill_utilization:.2f}"
        )
    if not args.no_components and last_profile is not None:
        components(last_profile, dtype, threads[configs[-1]])
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}")
    return 0


def components(profile: HardwareProfile, dtype: str, threads: int) -> None:
    """The engine's own prefill and decode times here vs the model's, from the same profile."""
    import torch

    from pdserve_worker.kv.cache import KVCache
    from pdserve_worker.model.loading.loader import load_model

    torch.set_num_threads(threads)
    model = ServingModel(SMOLLM2_135M, profile)
    engine = load_model(None, dtype=dtype).model
    gen = torch.Generator().manual_seed(0)

    def timed(fn, repeats: int = 3) -> tuple[float, float]:
        fn()
        cpu, wall = [], []
        for _ in range(repeats):
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            cpu.append((time.process_time() - c0) / threads)
            wall.append(time.perf_counter() - t0)
        return statistics.median(cpu), statistics.median(wall)

    print(f"\nengine alone, {threads} thread(s) ({dtype}): the model's service time vs the engine's, CPU time and wall")
    for n in (128, 1024, 2048):
        cache = KVCache.allocate(engine.config.kv_layout(1, n, dtype))
        ids = torch.randint(100, engine.config.vocab_size, (n,), generator=gen).tolist()
        cpu, wall = timed(lambda: engine.prefill(ids, cache, 0))
        predicted = model.prefill_seconds(n)
        print(
            f"  prefill {n:>5} tokens: model {predicted * 1e3:7.0f} ms   engine CPU {cpu * 1e3:7.0f} ms (ratio "
            f"{predicted / cpu:.2f})   wall {wall * 1e3:7.0f} ms"
        )
    context = 1024
    for batch in (1, 8):
        cache = KVCache.allocate(engine.config.kv_layout(batch, context + 40, dtype))
        slots = list(range(batch))
        for slot in slots:
            engine.prefill(torch.randint(100, 1000, (context,), generator=gen).tolist(), cache, slot)
        state = {"pos": context}

        def step() -> None:
            engine.decode_step(cache, slots, [state["pos"]] * batch, [7] * batch)
            state["pos"] += 1

        cpu, wall = timed(step, repeats=15)
        predicted = model.decode_step_seconds(batch, batch * (context + 8))
        print(
            f"  decode step, batch {batch}, context {context}: model {predicted * 1e3:6.1f} ms   engine CPU "
            f"{cpu * 1e3:6.1f} ms (ratio {predicted / cpu:.2f})   wall {wall * 1e3:6.1f} ms"
        )


if __name__ == "__main__":
    sys.exit(main())
