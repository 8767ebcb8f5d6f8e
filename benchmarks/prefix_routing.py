"""Prefix routing from the prefills' reports against the router's own prediction (issue #30).

Run:    .venv/bin/python benchmarks/prefix_routing.py [--servers events,predict,vllm]

`pdserve local --prefill 2 --decode 1 --routers 2 --api-keys` (3 tenants) on the HF folder of
benchmarks/vs_vllm.py, once with `PDSERVE_PREFIX_ROUTING=events` (the default: routers follow
every prefill's `Prefill.BlockEvents`) and once with `predict` (each router predicts from its
own routing history). vLLM (CPU, prefix caching on, one instance: no routing to get wrong)
serves the same trace with a `cache_salt` per tenant, for reference.

The trace: 3 tenants x 2 system prompts of 600 tokens x 2 conversations each (12
conversations), 3 turns, each turn the conversation so far plus a 48-token question; requests
one at a time, turn by turn across the conversations, **alternating between the two routers**
(as a load balancer in front of them would). 4 tokens out. Hit rate = cached prompt tokens /
whole-block prompt tokens; the oracle: each request finds every whole block it shares with an
earlier request of its tenant (an unbounded cache, perfect routing). Targets: events >=
predict, and within 10% of the oracle. Writes benchmarks/figures/prefix_routing.{json,png}.
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
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve  # noqa: E402
import vs_vllm  # noqa: E402
from prefix_tenants import Client, keys_file  # noqa: E402
from seed_transfer import machine  # noqa: E402

ROOT = serve.ROOT
TENANTS, SYSTEMS, CONVERSATIONS, TURNS = "ABC", 2, 2, 3
SYSTEM_TOKENS, QUESTION_TOKENS, BLOCK = 600, 48, 16


def trace(tokenizer: Any, rng: random.Random) -> list[tuple[str, str]]:
    """(tenant, prompt) in sending order: turn by turn across every conversation."""
    convs = []
    for tenant in TENANTS:
        for _ in range(SYSTEMS):
            system = vs_vllm.prompt_text(tokenizer, SYSTEM_TOKENS, rng)
            convs += [(tenant, system) for _ in range(CONVERSATIONS)]
    out, texts = [], [c[1] for c in convs]
    for _ in range(TURNS):
        for i, (tenant, _) in enumerate(convs):
            texts[i] = f"{texts[i]} Q: {vs_vllm.prompt_text(tokenizer, QUESTION_TOKENS, rng)} A:"
            out.append((tenant, texts[i]))
    return out


def oracle(tokenizer: Any, requests: list[tuple[str, str]]) -> float:
    """Hit rate with an unbounded per-tenant cache and perfect routing."""
    seen: dict[str, list[list[int]]] = {}
    hit = whole = 0
    for tenant, text in requests:
        ids = tokenizer.encode(text)
        cap = (len(ids) - 1) // BLOCK * BLOCK
        best = 0
        for other in seen.get(tenant, []):
            n = 0
            while n < min(len(other), len(ids)) and other[n] == ids[n]:
                n += 1
            best = max(best, n // BLOCK * BLOCK)
        hit += min(best, cap)
        whole += cap
        seen.setdefault(tenant, []).append(ids)
    return hit / whole


async def run(urls: list[str], tenants: str, requests: list[tuple[str, str]], label: str) -> dict[str, Any]:
    clients = [Client(url, tenants) for url in urls]
    for c in clients:
        await c.start()
    cached = 0
    ttfts = []
    try:
        for i, (tenant, text) in enumerate(requests):
            r = await clients[i % len(clients)].ask(serve.Request(0.0, text, 0), tenant, 4)
            cached += r.cached_tokens
            ttfts.append(r.ttft or 0.0)
            if (i + 1) % 12 == 0:
                print(f"    {label}: {i + 1}/{len(requests)} cached so far {cached}", flush=True)
    finally:
        for c in clients:
            await c.close()
    return {"cached_tokens": cached, "ttft_p50_s": serve.pct(ttfts, 50), "ttfts": ttfts}


def plot(results: dict[str, Any], path: Path, where: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in results if isinstance(results[n], dict) and "hit_rate" in results[n]]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(names, [results[n]["hit_rate"] for n in names], color="#4c72b0")
    ax.axhline(results["oracle_hit_rate"], color="k", ls="--", lw=1, label="oracle (unbounded, perfect routing)")
    ax.set_ylabel("prefix cache hit rate")
    ax.set_title("3 tenants, multi-turn, 2 prefills behind 2 routers (requests alternate)")
    ax.legend(fontsize=8)
    fig.suptitle(textwrap.fill(where, 120), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", default="events,predict,vllm")
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
    requests = trace(tokenizer, random.Random(5))
    whole = sum((len(tokenizer.encode(t)) - 1) // BLOCK * BLOCK for _, t in requests)
    where = f"{machine()}, {datetime.date.today()}, SmolLM2-135M {dtype}"
    print(f"# prefix_routing {datetime.datetime.now().isoformat(timespec='seconds')} on {where}", flush=True)
    logs = Path(tempfile.mkdtemp(prefix="prefix-routing-"))
    results: dict[str, Any] = {"oracle_hit_rate": oracle(tokenizer, requests), "requests": len(requests)}
    print(f"# {len(requests)} requests, oracle hit rate {results['oracle_hit_rate']:.3f}", flush=True)
    for i, name in enumerate(args.servers.split(",")):
        if name == "vllm":
            if not args.vllm_python.exists():
                print(f"# vllm skipped: {args.vllm_python} missing (bash benchmarks/setup_vllm.sh)", flush=True)
                continue
            server = vs_vllm.start_vllm(
                folder, dtype, 18900 + i, logs, args.vllm_python, ("--enable-prompt-tokens-details",)
            )
            urls, mode = [server.url], "salt"
        else:
            extra = ["--prefill", "2", "--decode", "1", "--routers", "2", "--api-keys", str(keys_file(logs))]
            extra += ["--env", f"PDSERVE_PREFIX_ROUTING={name}"]
            server = vs_vllm.start_pdserve(name, str(folder), dtype, 18900 + i, logs, extra)
            urls = json.loads((logs / name / "deployment.json").read_text())["routers"]
            mode = "keys"
        try:
            row = asyncio.run(run(urls, mode, requests, name))
        finally:
            server.stop()
        row["hit_rate"] = row["cached_tokens"] / whole
        row["of_oracle"] = row["hit_rate"] / results["oracle_hit_rate"]
        results[name] = row
        print(
            f"  [{name}] hit rate {row['hit_rate']:.3f} ({row['of_oracle']:.2f} of the oracle), "
            f"TTFT p50 {row['ttft_p50_s']:.3f} s",
            flush=True,
        )
    report = {"where": where, "date": str(datetime.date.today()), "results": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefix_routing.json").write_text(json.dumps(report, indent=1))
    try:
        plot(results, args.out / "prefix_routing.png", where)
    except ImportError:
        print("# matplotlib missing (pip install '.[plots]'): no plot", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
