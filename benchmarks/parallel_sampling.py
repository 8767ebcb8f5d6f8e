"""Parallel sampling (n > 1) against vLLM (CPU): same weights, same client, one run (issue #31 item 2).

Setup (once; an optional peer):  bash benchmarks/setup_vllm.sh
Run:    .venv/bin/python benchmarks/parallel_sampling.py [--servers vllm,pd,pd-singles,colocated]
                                                       [--n 4] [--prompt-tokens 1000] [--quick]

Each request asks for n completions of one prompt (temperature 1, with --seed a seed each,
ignore_eos so every choice generates max_tokens), non-streamed, `--concurrency` requests at a time, every
request a prompt of its own. Servers, one at a time with both cores (benchmarks/vs_vllm.py
starts them the same way, on the same HF folder):
- `vllm`: vLLM forks the sequences in its scheduler (the prompt computed and held once);
- `pd`: `pdserve local --prefill 1 --decode 1`: the first copy prefills, the others find the
  prompt in that prefill's prefix cache and share its whole prompt blocks on the decode (only
  the tail is pushed again: api/prompt_copies.py, kv/blocks.py);
- `pd-singles`: the same deployment sent the n copies as n requests of their own, at once (what
  a client without n support does, and what pdserve's KV path did before the decode shared
  blocks): every copy pushes the whole prompt (one prefill runs them one after the other, so
  its prefix cache spares the later ones the compute all the same);
- `colocated`: `pdserve local --colocated` (one process, both cores; no KV to push).

Prints per server the request latency p50, output tokens/s and, for pdserve, the KV bytes the
prefill pushed and the prompt tokens it computed (not found in its prefix cache) per request
(from its /metrics); the ratios
pd ÷ vLLM and pd ÷ pd-singles. Writes parallel_sampling.json and a PNG to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

import serve
import vs_vllm
from seed_transfer import machine


@dataclass
class Load:
    prompts: list[str]
    n: int
    max_tokens: int
    concurrency: int
    singles: bool = False  # n requests of one choice each instead of one request of n
    seeded: bool = False  # a seed per request (choice i: seed + i)


@dataclass
class Outcome:
    latencies: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    failed: int = 0


async def one_request(
    client: httpx.AsyncClient, url: str, model: str, prompt: str, load: Load, seed: int, out: Outcome
) -> None:
    """One prompt's n choices: one request with n, or (singles) n requests at once."""
    body = {"model": model, "prompt": prompt, "max_tokens": load.max_tokens, "temperature": 1.0}
    body |= {"ignore_eos": True}
    seeds = [{"seed": seed + i} if load.seeded else {} for i in range(load.n)]
    bodies = [body | {"n": 1} | s for s in seeds] if load.singles else [body | {"n": load.n} | seeds[0]]
    started = time.perf_counter()
    replies = await asyncio.gather(*(client.post(f"{url}/v1/completions", json=b) for b in bodies))
    if any(r.status_code != 200 for r in replies):
        out.failed += 1
        print(f"    failed: {[r.status_code for r in replies]} {replies[0].text[:200]}", flush=True)
        return
    out.latencies.append(time.perf_counter() - started)
    out.completion_tokens += sum(r.json()["usage"]["completion_tokens"] for r in replies)


async def run_load(url: str, load: Load) -> tuple[Outcome, float]:
    out, gate = Outcome(), asyncio.Semaphore(load.concurrency)
    done = 0

    async def gated(i: int, prompt: str) -> None:
        nonlocal done
        async with gate:
            await one_request(client, url, model, prompt, load, 1000 * i, out)
        done += 1
        if done % max(1, len(load.prompts) // 4) == 0:
            print(f"    {done}/{len(load.prompts)} requests", flush=True)

    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]  # (each server names it)
        await asyncio.gather(*(gated(i, p) for i, p in enumerate(load.prompts)))
    return out, time.perf_counter() - started


def pdserve_counters(server: vs_vllm.Server, logs: Path) -> dict[str, float]:
    """The prefill's pushed KV bytes and computed prompt tokens, the decode's shared blocks."""
    from prometheus_client.parser import text_string_to_metric_families

    manifest = json.loads((logs / server.name / "deployment.json").read_text())
    wanted = {
        ("prefill", "pdserve_kv_transfer_bytes"): "kv_bytes_pushed",
        ("prefill", "pdserve_prefill_prompt_tokens"): "prompt_tokens_prefilled",
        ("prefill", "pdserve_prefill_prefix_hit_tokens"): "prefix_hit_tokens",
        ("decode", "pdserve_decode_kv_shared_blocks"): "decode_shared_blocks",
    }
    found = dict.fromkeys(wanted.values(), 0.0)
    for child in manifest["children"]:
        if not child.get("http"):
            continue
        for family in text_string_to_metric_families(httpx.get(f"http://{child['http']}/metrics", timeout=10).text):
            key = wanted.get((child["role"], family.name))
            if key is not None:
                found[key] += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return found


def measure(server: vs_vllm.Server, load: Load, logs: Path) -> dict[str, Any]:
    is_pdserve = server.name.startswith("pd")
    before = pdserve_counters(server, logs) if is_pdserve else {}
    out, wall = asyncio.run(run_load(server.url, load))
    row: dict[str, Any] = {
        "latency_p50_s": serve.pct(out.latencies, 50),
        "tok_per_s": out.completion_tokens / wall if wall else 0.0,
        "failed": out.failed,
        "requests": len(load.prompts),
    }
    if is_pdserve:
        after = pdserve_counters(server, logs)
        row |= {k: (after[k] - before[k]) / len(load.prompts) for k in after}  # per request (n choices)
        row["prompt_tokens_computed"] = row.pop("prompt_tokens_prefilled") - row["prefix_hit_tokens"]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", default="vllm,pd,pd-singles,colocated")
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="2 requests, 16 tokens out")
    parser.add_argument(
        "--seed",
        action="store_true",
        help="give each request a seed (vLLM 0.32 CPU's engine died on seeded requests with chunked prefills here)",
    )
    parser.add_argument("--vllm-python", type=Path, default=vs_vllm.VLLM_VENV / "bin" / "python")
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "pdserve-vs-vllm")
    parser.add_argument("--out", type=Path, default=serve.ROOT / "benchmarks" / "figures")
    args = parser.parse_args(argv)
    from pdserve_worker.cli.local_deployment import auto_dtype
    from pdserve_worker.model.tokenizer import Tokenizer

    if args.quick:
        args.requests, args.max_tokens = 2, 16
    dtype = auto_dtype()
    args.cache.mkdir(parents=True, exist_ok=True)
    folder = vs_vllm.hf_folder(dtype, args.cache)
    tokenizer = Tokenizer.from_dir(folder)
    rng = random.Random(31)
    where = f"{machine()}, {datetime.date.today()}, SmolLM2-135M {dtype}"
    print(f"# parallel_sampling {datetime.datetime.now().isoformat(timespec='seconds')} on {where}", flush=True)
    logs = Path(tempfile.mkdtemp(prefix="parallel-sampling-"))
    table: dict[str, dict[str, Any]] = {}
    for k, name in enumerate(args.servers.split(",")):
        server = start(name, folder, dtype, 18700 + k, logs, args)
        if server is None:
            continue
        try:
            warm = Load([vs_vllm.prompt_text(tokenizer, 300, rng)], 2, 8, 1)
            asyncio.run(run_load(server.url, warm))
            prompts = [
                vs_vllm.prompt_text(tokenizer, args.prompt_tokens, random.Random(i)) for i in range(args.requests)
            ]
            load = Load(prompts, args.n, args.max_tokens, args.concurrency, name.endswith("singles"), args.seed)
            print(f"  [{name}] {len(prompts)} requests × n={args.n}, {args.concurrency} at a time", flush=True)
            table[name] = measure(server, load, logs)
            print(f"  [{name}] {table[name]}", flush=True)
        finally:
            server.stop()
    report(table, args, where)
    return 0 if table else 1


def start(
    name: str, folder: Path, dtype: str, port: int, logs: Path, args: argparse.Namespace
) -> vs_vllm.Server | None:
    if name == "vllm":
        if not args.vllm_python.exists():
            print(f"# vllm skipped: {args.vllm_python} missing (bash benchmarks/setup_vllm.sh)", flush=True)
            return None
        return vs_vllm.start_vllm(folder, dtype, port, logs, args.vllm_python)
    if name in ("pd", "pd-singles"):
        return vs_vllm.start_pdserve(name, str(folder), dtype, port, logs, ["--prefill", "1", "--decode", "1"])
    if name == "colocated":
        return vs_vllm.start_pdserve(name, str(folder), dtype, port, logs, ["--colocated"])
    raise SystemExit(f"unknown server {name!r}")


def report(table: dict[str, dict[str, Any]], args: argparse.Namespace, where: str) -> None:
    base, pd, singles = table.get("vllm"), table.get("pd"), table.get("pd-singles")
    ratios: dict[str, float] = {}
    for name in ("pd", "colocated"):
        if base and name in table:
            ratios[f"{name}_latency_over_vllm"] = table[name]["latency_p50_s"] / base["latency_p50_s"]
            ratios[f"{name}_tok_s_over_vllm"] = table[name]["tok_per_s"] / base["tok_per_s"]
    if pd and singles:
        ratios["pd_kv_bytes_over_singles"] = pd["kv_bytes_pushed"] / max(1.0, singles["kv_bytes_pushed"])
        ratios["pd_computed_over_singles"] = pd["prompt_tokens_computed"] / max(1.0, singles["prompt_tokens_computed"])
        ratios["pd_latency_over_singles"] = pd["latency_p50_s"] / singles["latency_p50_s"]
    for name, row in table.items():
        print(
            f"{name:11s} " + "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
        )
    for k, v in ratios.items():
        print(f"{k} = {v:.3f}")
    args.out.mkdir(parents=True, exist_ok=True)
    setup = {"n": args.n, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens}
    setup |= {"requests": args.requests, "concurrency": args.concurrency}
    doc = {"machine": machine(), "date": str(datetime.date.today()), "setup": setup, "results": table, "ratios": ratios}
    (args.out / "parallel_sampling.json").write_text(json.dumps(doc, indent=1))
    try:
        plot(table, args.out / "parallel_sampling.png", where, setup)
        print(f"plot: {args.out / 'parallel_sampling.png'}")
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install -e '.[plots]')")


def plot(table: dict[str, dict[str, Any]], path: Path, where: str, setup: dict[str, int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(table)
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    panels = (
        ("latency_p50_s", "request latency p50 (s)"),
        ("tok_per_s", "output tokens/s"),
        ("kv_bytes_pushed", "KV MiB pushed per request"),
    )
    for ax, (key, title) in zip(axes, panels, strict=True):
        values = [table[n].get(key, 0.0) / (2**20 if key == "kv_bytes_pushed" else 1) for n in names]
        ax.bar(names, values, color=["#888" if n == "vllm" else "#2a7" for n in names])
        ax.set_title(title)
    fig.suptitle(
        f"n={setup['n']} choices of a {setup['prompt_tokens']}-token prompt, {setup['max_tokens']} out, "
        f"{setup['concurrency']} requests at a time — {where}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
