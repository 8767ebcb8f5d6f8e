"""The prefix cache as a user meets it (issue #30): on by default, per tenant, and what it costs.

Run:    .venv/bin/python benchmarks/prefix_tenants.py [--servers pd,pd-off,vllm] [--trials 6]

Servers, one at a time, each with both cores, the same HF folder (benchmarks/vs_vllm.py's
`hf_folder`: the bundled SmolLM2-135M in the dtype `pdserve local` picks here):
- `pd`: `pdserve local --prefill 1 --decode 1 --api-keys` with **no cache flag** (the default);
- `pd-off`: the same with `--prefix-cache-tokens 0` (the cost phase's baseline);
- `vllm`: vLLM (CPU) with its defaults (prefix caching on) and --enable-prompt-tokens-details,
  when `bash benchmarks/setup_vllm.sh` installed it. vLLM has no tenants: its "tenant" is a
  client; it is measured twice, without a `cache_salt` (its default) and with one per tenant.

Phases (one streaming client, benchmarks/serve.py's `one`, greedy, ignore_eos):
- defaults: 12 requests one at a time sharing a 1,000-token prefix (distinct 24-token tails),
  16 tokens out; warm/cold = median TTFT of requests 2..12 / TTFT of request 1; the cached
  tokens they report. Target: <= 0.2 and > 0 with no flag.
- isolation: `--trials` times, tenant A sends a fresh 1,000-token prefix P (+ tail); then B
  sends P (+ another tail) and a random prefix R of the same length. Ratio = median TTFT of B
  on P / median TTFT of B on R, and B's cached tokens on P. Target: within 1.2x and 0 (a
  leak shows as a ratio near warm/cold and cached tokens near 1,000).
- cost: 16 requests of 512 fresh tokens (no reuse), 4 at a time, 32 out: output tokens/s
  with the default cache against `pd-off`, the two deployments started alternately
  `--cost-rounds` times (median of each: the host is shared). Target: >= 0.98x.

Prints each figure and writes benchmarks/figures/prefix_tenants.{json,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import httpx  # noqa: E402

import serve  # noqa: E402
import vs_vllm  # noqa: E402
from seed_transfer import machine  # noqa: E402

ROOT = serve.ROOT
KEYS = {t: f"sk-bench-tenant-{t.lower()}-0123456789" for t in "ABC"}
PREFIX, TAIL, OUT = 1000, 24, 16


def keys_file(folder: Path) -> Path:
    path = folder / "keys.yaml"
    lines = ["tenants:"] + [f'  - name: tenant-{t.lower()}\n    keys: ["{k}"]' for t, k in KEYS.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


class Client:
    """One streaming client for one server; `tenant` picks a key (pdserve) or a salt (vLLM)."""

    def __init__(self, url: str, tenants: str) -> None:
        self.url, self.tenants = url, tenants  # "keys", "none" (vLLM default) or "salt" (vLLM cache_salt)
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(900.0, connect=10.0))
        self.model = ""

    async def start(self) -> None:
        self.model = (await self.http.get(f"{self.url}/v1/models", headers=self._headers("A"))).json()["data"][0]["id"]
        await self.ask(serve.Request(0.0, "hello there", 2), "A", 4)  # first-call costs are not the load's

    def _headers(self, tenant: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {KEYS[tenant]}"} if self.tenants == "keys" else {}

    async def ask(self, request: serve.Request, tenant: str, out: int = OUT) -> serve.Result:
        extra = {"cache_salt": f"tenant-{tenant}"} if self.tenants == "salt" else None
        result = await serve.one(
            self.http, self.url, self.model, request, out, time.monotonic(), self._headers(tenant), extra
        )
        if result.error is not None:
            raise RuntimeError(f"request failed: {result.error}")
        return result

    async def close(self) -> None:
        await self.http.aclose()


def text(tokenizer: Any, tokens: int, rng: random.Random) -> str:
    return vs_vllm.prompt_text(tokenizer, tokens, rng)


async def defaults_phase(client: Client, tokenizer: Any, rng: random.Random) -> dict[str, Any]:
    prefix = text(tokenizer, PREFIX, rng)
    results = []
    for i in range(12):
        results.append(await client.ask(serve.Request(0.0, f"{prefix} {text(tokenizer, TAIL, rng)}", 0), "A"))
        print(f"    defaults {i + 1}/12: TTFT {results[-1].ttft:.3f} s cached {results[-1].cached_tokens}", flush=True)
    cold = results[0].ttft or 0.0
    warm = serve.pct([r.ttft for r in results[1:] if r.ttft is not None], 50)
    return {
        "cold_ttft_s": cold,
        "warm_ttft_s": warm,
        "warm_over_cold": warm / cold if cold else None,
        "warm_cached_tokens_p50": serve.pct([r.cached_tokens for r in results[1:]], 50),
    }


async def isolation_phase(client: Client, tokenizer: Any, rng: random.Random, trials: int) -> dict[str, Any]:
    on_a, on_random, cached = [], [], []
    for i in range(trials):
        secret = text(tokenizer, PREFIX, rng)
        await client.ask(serve.Request(0.0, f"{secret} {text(tokenizer, TAIL, rng)}", 0), "A")
        probe = await client.ask(serve.Request(0.0, f"{secret} {text(tokenizer, TAIL, rng)}", 0), "B")
        fresh = await client.ask(
            serve.Request(0.0, f"{text(tokenizer, PREFIX, rng)} {text(tokenizer, TAIL, rng)}", 0), "B"
        )
        on_a.append(probe.ttft or 0.0)
        on_random.append(fresh.ttft or 0.0)
        cached.append(probe.cached_tokens)
        print(
            f"    isolation {i + 1}/{trials}: B on A's prefix {on_a[-1]:.3f} s (cached {cached[-1]}), "
            f"B on a random one {on_random[-1]:.3f} s",
            flush=True,
        )
    a, r = serve.pct(on_a, 50), serve.pct(on_random, 50)
    return {"b_on_a_ttft_s": a, "b_random_ttft_s": r, "ratio": a / r if r else None, "b_cached_max": max(cached)}


async def cost_phase(client: Client, tokenizer: Any, rng: random.Random) -> dict[str, Any]:
    requests = [serve.Request(0.0, text(tokenizer, 512, rng), 512) for _ in range(16)]
    gate = asyncio.Semaphore(4)

    async def limited(r: serve.Request) -> serve.Result:
        async with gate:
            return await client.ask(r, "A", 32)

    started = time.monotonic()
    results = await asyncio.gather(*(limited(r) for r in requests))
    wall = time.monotonic() - started
    return {"tok_per_s": sum(r.completion_tokens for r in results) / wall, "wall_s": wall}


async def measure(url: str, tenants: str, tokenizer: Any, phases: list[str], trials: int) -> dict[str, Any]:
    client = Client(url, tenants)
    await client.start()
    rng = random.Random(7)
    rows: dict[str, Any] = {}
    try:
        if "defaults" in phases:
            rows["defaults"] = await defaults_phase(client, tokenizer, rng)
        if "isolation" in phases:
            rows["isolation"] = await isolation_phase(client, tokenizer, rng, trials)
        if "cost" in phases:
            rows["cost"] = await cost_phase(client, tokenizer, rng)
    finally:
        await client.close()
    return rows


def start(name: str, folder: Path, dtype: str, port: int, logs: Path, args: argparse.Namespace) -> vs_vllm.Server:
    if name == "vllm":
        return vs_vllm.start_vllm(folder, dtype, port, logs, args.vllm_python, ("--enable-prompt-tokens-details",))
    extra = ["--prefill", "1", "--decode", "1", "--api-keys", str(keys_file(logs))]
    if name == "pd-off":
        extra += ["--prefix-cache-tokens", "0"]
    return vs_vllm.start_pdserve(name, str(folder), dtype, port, logs, extra)


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    rows = [(n, r) for n, r in results.items() if "defaults" in r or "isolation" in r]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    names = [n for n, _ in rows]
    left.bar(names, [r.get("defaults", {}).get("warm_over_cold") or 0 for _, r in rows], color="#4c72b0")
    left.axhline(0.2, color="k", ls="--", lw=1, label="target 0.2")
    left.set_title("shared 1,000-token prefix: warm / cold TTFT (lower: cache works)")
    left.legend()
    right.bar(names, [r.get("isolation", {}).get("ratio") or 0 for _, r in rows], color="#dd8452")
    right.axhline(1.0, color="k", ls="--", lw=1, label="no leak (1.0)")
    right.set_title("tenant B on A's prefix / on a random one (TTFT)")
    right.legend()
    for ax in (left, right):
        ax.tick_params(axis="x", rotation=20)
    fig.suptitle(textwrap.fill(report["where"], 120), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", default="pd,pd-off,vllm")
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--cost-rounds", type=int, default=3, help="alternate starts of pd and pd-off for the cost")
    parser.add_argument("--vllm-python", type=Path, default=vs_vllm.VLLM_VENV / "bin" / "python")
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "pdserve-vs-vllm")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "figures")
    args = parser.parse_args(argv)
    from pdserve_worker.cli.local_deployment import auto_dtype
    from pdserve_worker.model.tokenizer import Tokenizer

    dtype = auto_dtype()
    args.cache.mkdir(parents=True, exist_ok=True)
    folder = vs_vllm.hf_folder(dtype, args.cache)
    tokenizer = Tokenizer.from_dir(folder)
    where = f"{machine()}, {datetime.date.today()}, SmolLM2-135M {dtype}"
    print(f"# prefix_tenants {datetime.datetime.now().isoformat(timespec='seconds')} on {where}", flush=True)
    logs = Path(tempfile.mkdtemp(prefix="prefix-tenants-"))
    results: dict[str, Any] = {}
    for i, name in enumerate(args.servers.split(",")):
        if name == "vllm" and not args.vllm_python.exists():
            print(f"# vllm skipped: {args.vllm_python} missing (bash benchmarks/setup_vllm.sh)", flush=True)
            continue
        started = time.perf_counter()
        server = start(name, folder, dtype, 18700 + i, logs, args)
        print(f"# {name} serving after {time.perf_counter() - started:.0f} s", flush=True)
        try:
            if name == "vllm":
                for mode in ("none", "salt"):
                    label = "vllm" if mode == "none" else "vllm+cache_salt"
                    phases = ["defaults", "isolation"] if mode == "none" else ["isolation"]
                    results[label] = asyncio.run(measure(server.url, mode, tokenizer, phases, args.trials))
                    print(f"  [{label}] {results[label]}", flush=True)
            else:
                phases = ["cost"] if name == "pd-off" else ["defaults", "isolation", "cost"]
                results[name] = asyncio.run(measure(server.url, "keys", tokenizer, phases, args.trials))
                print(f"  [{name}] {results[name]}", flush=True)
        finally:
            server.stop()
    if "pd" in results and "pd-off" in results:
        runs = {name: [results[name]["cost"]["tok_per_s"]] for name in ("pd", "pd-off")}
        for r in range(1, args.cost_rounds):
            for i, name in enumerate(("pd", "pd-off")):
                server = start(name, folder, dtype, 18710 + 2 * r + i, logs, args)
                try:
                    row = asyncio.run(measure(server.url, "keys", tokenizer, ["cost"], args.trials))["cost"]
                finally:
                    server.stop()
                runs[name].append(row["tok_per_s"])
                print(f"  [{name}] cost round {r + 1}/{args.cost_rounds}: {row['tok_per_s']:.1f} tok/s", flush=True)
        on, off = serve.pct(runs["pd"], 50), serve.pct(runs["pd-off"], 50)
        results["cost_runs_tok_per_s"] = runs
        results["cost_on_over_off"] = on / off
        print(
            f"# no-reuse throughput (median), cache on / off: {on:.1f} / {off:.1f} tok/s = {on / off:.3f}", flush=True
        )
    report = {"where": where, "date": str(datetime.date.today()), "results": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefix_tenants.json").write_text(json.dumps(report, indent=1))
    try:
        plot(
            {**report, "results": {k: v for k, v in results.items() if isinstance(v, dict)}},
            args.out / "prefix_tenants.png",
        )
    except ImportError:
        print("# matplotlib missing (pip install '.[plots]'): no plot", flush=True)
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
