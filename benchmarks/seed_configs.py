"""Seed 000's table on this machine: colocated against 1P1D, 1P2D, 1P4D and 2P4D, and the
planner's prediction of the seed's own Ascend 910 setting beside the seed's figures.

Run:  .venv/bin/python benchmarks/seed_configs.py [--configs colocated,1p1d,1p2d,1p4d,2p4d]
                                                 [--decode-mode replicas|shards] [--out benchmarks/figures]

Part 1, measured. Each configuration is a `pdserve local` deployment (real processes on
127.0.0.1, the bundled SmolLM2-135M with the deployment's default weights and dtype), started
one after the other, with the same requests, timed at a streaming /v1/completions client
(benchmarks/serve.py's client):
- prefill latency: TTFT of requests sent one at a time (no queueing: prefill, push, first
  token), the median of `--lone` requests;
- TPOT p50/p99 and total output tokens/s: `--burst` requests sent at once, each
  `--output-tokens` long (ignore_eos).
The seed's workload (4,096-token prompts, 256 output tokens, LLaMA-7B on NPUs) is scaled to
what 2 vCPUs serve in minutes: `--prompt-tokens` (default 512) and `--output-tokens` (64).
How the 2 cores are shared: `pdserve local` gives every model process an equal share of the
CPUs, at least one torch thread each; colocated runs one process with both cores, 1P1D two
processes with one thread each, 2P4D six processes on two cores (oversubscribed: on the
seed's hardware each role has its own NPU, here they take turns on the same cores). So the
table shows what the roles cost on one host, not what separate devices buy.

`--decode-mode shards` reads the seed's "1P+2D: 2 个 decode 并行（层分片）" literally: the D
decodes are one layer-sharded group (pdserve's `--layer-shards D`) instead of D replicas.

Part 2, predicted. The planner (`pdserve plan`'s model, operator/pdserve_operator/planner) with
the bundled `ascend-910b` profile for the seed's setting: LLaMA-7B, 4,096-token prompts, 256
output tokens. Prefill latency = one prompt's service time; TPOT = the mean at a light load
(0.12 requests/s, the decode batch about 1, as the seed's figures imply); throughput = output
tokens/s at the highest arrival rate that keeps the prefills below 90% utilisation with the KV
fitting. Each beside the seed's figure, with the ratio predicted ÷ seed. The planner models
D decode replicas, not a layer-sharded group; it has no colocated model.

Writes a PNG (measured TPOT and throughput per configuration) and a JSON to `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve  # noqa: E402  (its client, trace and percentile; it puts worker/, operator/ on sys.path)
from pdserve_worker.cli.local_deployment import LocalDeployment  # noqa: E402
from pdserve_worker.cli.local_plan import LocalPlan  # noqa: E402
from seed_transfer import machine  # noqa: E402

SHAPES = {"colocated": (0, 0), "1p1d": (1, 1), "1p2d": (1, 2), "1p4d": (1, 4), "2p4d": (2, 4)}
# The seed's table (shared/seeds/000, LLaMA-7B on Ascend 910, seq 4096, 256 tokens):
# prefill latency s, decode TPOT ms, total throughput tokens/s.
SEED = {
    "colocated": (4.2, 46, 18.2),
    "1p1d": (4.2, 27, 31.0),
    "1p2d": (4.2, 14, 59.8),
    "1p4d": (4.2, 8, 106.2),
    "2p4d": (2.3, 8, 212.4),
}
SEED_PROMPT, SEED_OUTPUT = 4096, 256


def plan_for(name: str, args: argparse.Namespace) -> LocalPlan:
    p, d = SHAPES[name]
    common: dict[str, Any] = dict(port=0, slots=args.slots, max_len=args.prompt_tokens + args.output_tokens + 64)
    if name == "colocated":
        return LocalPlan(colocated=True, **common)
    if args.decode_mode == "shards" and d > 1:
        return LocalPlan(prefill=p, decode=1, layer_shards=d, **common)
    return LocalPlan(prefill=p, decode=d, **common)


def requests(args: argparse.Namespace, tokenizer: Any, count: int, seed: int) -> list[serve.Request]:
    """`count` prompts of exactly `--prompt-tokens` tokens (serve.py's word soup)."""
    trace = serve.make_trace(count, 1.0, 0.0, (args.prompt_tokens, args.prompt_tokens), (1, 1), tokenizer, seed)
    return [serve.Request(0.0, r.prompt, r.prompt_tokens) for r in trace]


def measure(name: str, args: argparse.Namespace, tokenizer: Any) -> dict[str, Any]:
    plan = plan_for(name, args)
    started = time.perf_counter()
    shape = "one colocated process" if plan.colocated else f"{plan.prefill} prefill / {plan.decode} decode"
    print(f"[{name}] starting {shape} (layer shards {plan.layer_shards}) ...", flush=True)
    with LocalDeployment(plan, progress=None) as deployment:
        url = deployment.start(timeout_s=900)
        print(f"[{name}] serving after {time.perf_counter() - started:.0f} s; {args.lone} lone requests", flush=True)
        lone, _ = asyncio.run(serve.drive(url, requests(args, tokenizer, args.lone, 1), args.output_tokens, True))
        print(f"[{name}] burst of {args.burst}", flush=True)
        burst, wall = asyncio.run(serve.drive(url, requests(args, tokenizer, args.burst, 2), args.output_tokens))
    failed = [r.error for r in lone + burst if r.error]
    ttft = [r.ttft for r in lone if r.ttft is not None]
    tpot = [r.tpot for r in burst if r.tpot is not None]
    row = {
        "config": name,
        "processes": "1" if plan.colocated else f"{plan.prefill}+{plan.decode * plan.layer_shards}",
        "prefill_latency_s": statistics.median(ttft) if ttft else float("nan"),
        "tpot_lone_ms": statistics.median(r.tpot for r in lone if r.tpot is not None) * 1e3,
        "tpot_p50_ms": serve.pct(tpot, 50) * 1e3,
        "tpot_p99_ms": serve.pct(tpot, 99) * 1e3,
        "ttft_burst_p50_s": serve.pct([r.ttft for r in burst if r.ttft is not None], 50),
        "tok_per_s": sum(r.completion_tokens for r in burst if r.error is None) / wall,
        "failed": len(failed),
    }
    for error in failed:
        print(f"[{name}] request failed: {error}", file=sys.stderr)
    print(f"[{name}] done in {time.perf_counter() - started:.0f} s: {row}", flush=True)
    return row


def predicted() -> dict[str, tuple[float, float, float]]:
    """The planner's (prefill latency s, TPOT ms, output tok/s) for the seed's Ascend setting."""
    sys.path.insert(0, str(serve.ROOT / "operator"))
    from pdserve_operator.planner import SLO, LengthDistribution, ServingModel, Workload, bundled_profile, predict
    from pdserve_operator.planner.model_shape import LLAMA_7B

    model = ServingModel(LLAMA_7B, bundled_profile("ascend-910b"), max_len=SEED_PROMPT + SEED_OUTPUT)
    workload = Workload(
        arrival_rate=0,
        prompt_tokens=LengthDistribution(fixed=SEED_PROMPT),
        output_tokens=LengthDistribution(fixed=SEED_OUTPUT),
        slo=SLO(quantile=0.99),
    )
    out = {}
    for name, (p, d) in SHAPES.items():
        if p == 0:
            continue
        tpot = predict(model, workload.with_rate(0.12), p, d).tpot_mean_s
        lo, hi = 0.0, 100.0  # the highest sustainable rate, by bisection
        for _ in range(40):
            mid = (lo + hi) / 2
            pred = predict(model, workload.with_rate(mid), p, d)
            lo, hi = (mid, hi) if pred.prefill_utilization < 0.9 and pred.kv_fits else (lo, mid)
        out[name] = (model.prefill_service_seconds(SEED_PROMPT), tpot * 1e3, lo * SEED_OUTPUT)
    return out


def print_measured(rows: list[dict[str, Any]]) -> None:
    print(
        "\n| config | model processes on 2 vCPU | prefill latency (lone TTFT) | TPOT lone | TPOT p50 / p99 (burst) | TTFT p50 (burst) | output tok/s (burst) | failed |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['config']} | {r['processes']} | {r['prefill_latency_s']:.2f} s | {r['tpot_lone_ms']:.0f} ms | "
            f"{r['tpot_p50_ms']:.0f} / {r['tpot_p99_ms']:.0f} ms | {r['ttft_burst_p50_s']:.1f} s | "
            f"{r['tok_per_s']:.1f} | {r['failed']} |"
        )


def print_predicted(pred: dict[str, tuple[float, float, float]]) -> None:
    print(
        "\n| config | prefill latency: seed / planner (ratio) | TPOT ms: seed / planner (ratio) | tok/s: seed / planner (ratio) |"
    )
    print("|---|---|---|---|")
    for name, seed in SEED.items():
        if name not in pred:
            print(f"| {name} | {seed[0]} s / not modelled | {seed[1]} / not modelled | {seed[2]} / not modelled |")
            continue
        cells = [f"{s:g}{unit} / {p:.3g}{unit} ({p / s:.2f})" for s, p, unit in zip(seed, pred[name], (" s", "", ""))]
        print(f"| {name} | " + " | ".join(cells) + " |")


def plot(rows: list[dict[str, Any]], path: Path, where: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["config"] for r in rows]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(14, 4.5))
    a.bar(names, [r["prefill_latency_s"] for r in rows], color="tab:blue")
    a.set_title("prefill latency (lone TTFT, s)", fontsize=9)
    x = range(len(rows))
    b.bar([i - 0.2 for i in x], [r["tpot_p50_ms"] for r in rows], 0.4, label="p50")
    b.bar([i + 0.2 for i in x], [r["tpot_p99_ms"] for r in rows], 0.4, label="p99")
    b.set_xticks(list(x), names)
    b.set_title("TPOT under the burst (ms)", fontsize=9)
    b.legend(fontsize=8)
    c.bar(names, [r["tok_per_s"] for r in rows], color="tab:green")
    c.set_title("total output tokens/s (burst)", fontsize=9)
    fig.suptitle(f"seed 000's configurations on one 2-vCPU host — {where}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=",".join(SHAPES))
    parser.add_argument("--decode-mode", choices=["replicas", "shards"], default="replicas")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--lone", type=int, default=3, help="requests sent one at a time (prefill latency)")
    parser.add_argument("--burst", type=int, default=8, help="requests sent at once (TPOT, throughput)")
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--predict-only", action="store_true", help="only the planner's side (seconds)")
    parser.add_argument("--out", type=Path, default=serve.ROOT / "benchmarks" / "figures")
    args = parser.parse_args(argv)
    pred = predicted()
    rows: list[dict[str, Any]] = []
    where = f"{machine()}, {datetime.date.today()}"
    if not args.predict_only:
        from pdserve_worker.cli.local_deployment import auto_dtype
        from pdserve_worker.model.loading.loader import model_folder
        from pdserve_worker.model.tokenizer import Tokenizer

        folder, model = model_folder(None, auto_dtype())
        tokenizer = Tokenizer.from_dir(folder)
        print(
            f"# seed_configs {datetime.datetime.now().isoformat(timespec='seconds')} on {where}; {model}; "
            f"{args.prompt_tokens}-token prompts, {args.output_tokens} output tokens; decode mode {args.decode_mode}; "
            f"{len(os.sched_getaffinity(0))} CPUs",
            flush=True,
        )
        rows = [measure(name, args, tokenizer) for name in args.configs.split(",")]
        print_measured(rows)
    print_predicted(pred)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"machine": machine(), "date": str(datetime.date.today()), "args": vars(args) | {"out": str(args.out)}}
    report |= {"measured": rows, "predicted": pred, "seed": SEED}
    suffix = "" if args.decode_mode == "replicas" else "_shards"
    (args.out / f"seed_configs{suffix}.json").write_text(json.dumps(report, indent=1))
    if rows:
        try:
            plot(rows, args.out / f"seed_configs{suffix}.png", where)
            print(f"plot: {args.out / f'seed_configs{suffix}.png'}")
        except ImportError:
            print("plot skipped: matplotlib is not installed (pip install -e '.[plots]')")
    return 1 if any(r["failed"] for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
