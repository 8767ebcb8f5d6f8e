"""The prefix cache's tiers (issue #30): a working set 4x the RAM tier, replayed, and a restart.

Run:    .venv/bin/python benchmarks/prefix_tiers.py [--servers ram,disk,vllm]

`pdserve local --prefill 1 --decode 1 --prefix-cache-tokens 4096 --on-exit restart` on the
same HF folder as benchmarks/vs_vllm.py, as
- `ram`: the RAM tier only;
- `disk`: with `--prefix-disk-dir` (a fresh folder);
- `vllm`: vLLM (CPU) with its defaults (prefix caching on, 4 GiB of KV space, which holds the
  whole working set: no eviction) and --enable-prompt-tokens-details, for reference.

The trace: 16 prompts of 1,024 fresh tokens (16,384 tokens, 4x the RAM tier), 8 tokens out,
one at a time, replayed twice; hit rate = cached prompt tokens / whole-block prompt tokens of
the pass, with TTFT p50. Then, for `disk`: the prefill is killed (SIGKILL, its PID from
deployment.json), `pdserve local` restarts it, and the first pass after it is measured.
Targets: second-pass hit rate >= 0.9 with the disk tier; first pass after the restart >= 0.8.
Writes benchmarks/figures/prefix_tiers.{json,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import signal
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
from prefix_tenants import Client  # noqa: E402
from seed_transfer import machine  # noqa: E402

ROOT = serve.ROOT
RAM_TOKENS, PROMPTS, PROMPT_TOKENS, BLOCK = 4096, 16, 1024, 16


async def replay(url: str, prompts: list[str], label: str) -> dict[str, Any]:
    client = Client(url, "none")
    await client.start()
    rows = []
    try:
        for i, text in enumerate(prompts):
            r = await client.ask(serve.Request(0.0, text, 0), "A", 8)
            rows.append(r)
            if (i + 1) % 4 == 0:
                print(
                    f"    {label}: {i + 1}/{len(prompts)} (last TTFT {r.ttft:.3f} s, cached {r.cached_tokens})",
                    flush=True,
                )
    finally:
        await client.close()
    whole = len(prompts) * (PROMPT_TOKENS - 1) // BLOCK * BLOCK
    return {
        "hit_rate": sum(r.cached_tokens for r in rows) / whole,
        "ttft_p50_s": serve.pct([r.ttft for r in rows if r.ttft is not None], 50),
    }


def kill_prefill(log_dir: Path) -> int:
    manifest = json.loads((log_dir / "deployment.json").read_text())
    [child] = [c for c in manifest["children"] if c["role"] == "prefill"]
    os.kill(child["pid"], signal.SIGKILL)  # our own child, by its PID
    return int(child["pid"])


def wait_restarted(url: str, log_dir: Path, old_pid: int, timeout_s: float = 300.0) -> float:
    """Seconds until `pdserve local` restarted the prefill and a request is served again."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        manifest = json.loads((log_dir / "deployment.json").read_text())
        pids = [c["pid"] for c in manifest["children"] if c["role"] == "prefill"]
        if pids and pids[0] != old_pid:
            body = {"model": "smollm2", "prompt": "ping", "max_tokens": 1}
            model = httpx.get(f"{url}/v1/models", timeout=5).json()["data"][0]["id"]
            if httpx.post(f"{url}/v1/completions", json={**body, "model": model}, timeout=120).status_code == 200:
                return time.monotonic() - started
        time.sleep(0.5)
    raise TimeoutError("the prefill was not back within the timeout")


def plot(results: dict[str, Any], path: Path, where: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    passes = ["pass1", "pass2", "after_restart"]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(1, len(results))
    for i, (name, row) in enumerate(results.items()):
        xs = [j + i * width for j in range(len(passes))]
        ax.bar(xs, [row.get(p, {}).get("hit_rate", 0) for p in passes], width, label=name)
    ax.axhline(0.9, color="k", ls="--", lw=1, label="target 0.9 (pass 2, disk)")
    ax.axhline(0.8, color="grey", ls=":", lw=1, label="target 0.8 (after restart)")
    ax.set_xticks([j + width * (len(results) - 1) / 2 for j in range(len(passes))], passes)
    ax.set_ylabel("prefix cache hit rate")
    ax.set_title("working set 4x the RAM tier, replayed twice, then a prefill restart")
    ax.legend(fontsize=7)
    fig.suptitle(textwrap.fill(where, 120), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", default="ram,disk,vllm")
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
    rng = random.Random(3)
    prompts = [vs_vllm.prompt_text(tokenizer, PROMPT_TOKENS, rng) for _ in range(PROMPTS)]
    where = f"{machine()}, {datetime.date.today()}, SmolLM2-135M {dtype}"
    print(f"# prefix_tiers {datetime.datetime.now().isoformat(timespec='seconds')} on {where}", flush=True)
    logs = Path(tempfile.mkdtemp(prefix="prefix-tiers-"))
    results: dict[str, Any] = {}
    for i, name in enumerate(args.servers.split(",")):
        if name == "vllm":
            if not args.vllm_python.exists():
                print(f"# vllm skipped: {args.vllm_python} missing (bash benchmarks/setup_vllm.sh)", flush=True)
                continue
            server = vs_vllm.start_vllm(
                folder, dtype, 18800 + i, logs, args.vllm_python, ("--enable-prompt-tokens-details",)
            )
        else:
            extra = [
                "--prefill",
                "1",
                "--decode",
                "1",
                "--prefix-cache-tokens",
                str(RAM_TOKENS),
                "--on-exit",
                "restart",
            ]
            if name == "disk":
                extra += ["--prefix-disk-dir", str(logs / "prefix-disk")]
            server = vs_vllm.start_pdserve(name, str(folder), dtype, 18800 + i, logs, extra)
        try:
            row = {"pass1": asyncio.run(replay(server.url, prompts, f"{name} pass 1"))}
            row["pass2"] = asyncio.run(replay(server.url, prompts, f"{name} pass 2"))
            if name == "disk":
                old = kill_prefill(logs / name)
                row["restart_s"] = wait_restarted(server.url, logs / name, old)
                row["after_restart"] = asyncio.run(replay(server.url, prompts, f"{name} after restart"))
            results[name] = row
            print(f"  [{name}] {row}", flush=True)
        finally:
            server.stop()
    report = {"where": where, "date": str(datetime.date.today()), "ram_tokens": RAM_TOKENS, "results": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefix_tiers.json").write_text(json.dumps(report, indent=1))
    try:
        plot(results, args.out / "prefix_tiers.png", where)
    except ImportError:
        print("# matplotlib missing (pip install '.[plots]'): no plot", flush=True)
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
