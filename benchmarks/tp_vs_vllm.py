"""Tensor parallelism against vLLM's, through the servers (issue #32): what tp 2 does to a long
prompt's time to first token, side by side in one run, the same model and client.

    bash benchmarks/setup_vllm.sh   # once: vLLM (CPU) in .venv-vllm, an optional peer
    PYTHONPATH=worker:common:proto:tests python benchmarks/tp_vs_vllm.py [--tokens 2000] [--requests 5]

The model is tensor_parallel.py's: SmolLM2's depth and width class with 8 query heads over 4
KV heads (30 layers, hidden 512; random weights, a tiny tokenizer), which tp 2 splits (the
bundled SmolLM2-135M's 9 heads do not, for vLLM: it refuses an uneven split). One HF folder,
bf16 in both servers. Four servers, one at a time, each warmed up the same way, then
`--requests` prompts of `--tokens` tokens one after the other, 8 output tokens each:
- vLLM, tp 1 (both cores, `VLLM_CPU_OMP_THREADS_BIND=0-1`) and tp 2 (`--tensor-parallel-size
  2`, a core per rank: `0|1`);
- pdserve 1P1D (`pdserve local`, which shares the cores among its model processes: the prefill
  gets 1 thread), the same with `--threads 2` (the prefill gets both cores, as vLLM's tp 1
  does), and 1P1D with `--prefill-tp 2` (the prefill's two ranks, 1 thread each, gloo
  all_reduce, each pushing its own heads' KV to the decode).
Prints TTFT p50 per server and the tp 2 ÷ tp 1 ratio of each, with progress; writes
benchmarks/figures/tp_vs_vllm.{json,png}. On 2 cores tensor parallelism cannot make a prefill
faster (the two ranks share the cores one process had); what is compared is what it costs.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vs_vllm as vv  # noqa: E402  (its servers, client and summaries)
from tensor_parallel import SHAPE  # noqa: E402

FIGURES = Path(__file__).resolve().parent / "figures"
SERVERS = ("vllm-tp1", "vllm-tp2", "pdserve-tp1", "pdserve-tp1-threads2", "pdserve-tp2")


def start(name: str, folder: Path, port: int, logs: Path, vllm_python: Path) -> vv.Server:
    print(f"# starting {name} ...", flush=True)
    if name == "vllm-tp1":
        return vv.start_vllm(folder, "bfloat16", port, logs, vllm_python)
    if name == "vllm-tp2":  # a core per rank
        return vv.start_vllm(folder, "bfloat16", port, logs, vllm_python, ("--tensor-parallel-size", "2"), "0|1")
    extra = ["--prefill", "1", "--decode", "1"]
    extra += {"pdserve-tp2": ["--prefill-tp", "2"], "pdserve-tp1-threads2": ["--threads", "2"]}.get(name, [])
    return vv.start_pdserve(name, str(folder), "bfloat16", port, logs, extra)


def measure(server: vv.Server, tokenizer: Any, tokens: int, requests: int) -> dict[str, Any]:
    vv.warm_up(server, tokenizer)
    s = vv.Scenario(f"tp-{tokens}", tokens, 8, requests, 1)
    results, wall = asyncio.run(vv.run_scenario(server.url, s, vv.scenario_requests(s, tokenizer, vv.seed_of(s.name))))
    row = vv.summarize(results, wall)
    print(f"  [{server.name}] TTFT p50 {row['ttft_p50_s']:.3f} s, failed {row['failed']}", flush=True)
    return row


def plot(table: dict[str, dict[str, Any]], path: Path, where: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(table)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(names, [table[n]["ttft_p50_s"] for n in names], color=["#888", "#bbb", "#1f77b4", "#4a90c8", "#8fbbd9"])
    ax.tick_params(axis="x", labelrotation=20)
    ax.set_ylabel("TTFT p50 (s)")
    ax.set_title(f"TTFT, tp 1 vs tp 2, same model and client\n{where}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--vllm-python", type=Path, default=vv.VLLM_VENV / "bin" / "python")
    parser.add_argument("--port", type=int, default=8731)
    args = parser.parse_args(argv)
    if not args.vllm_python.exists():
        print(f"vLLM is not set up ({args.vllm_python}): run benchmarks/setup_vllm.sh first", file=sys.stderr)
        return 2
    from transformers import AutoTokenizer

    from support.tiny_model import write_tiny_model

    work = Path(tempfile.mkdtemp(prefix="pdserve-tp-vllm-"))
    folder = write_tiny_model(work / "model", **{**SHAPE, "max_position_embeddings": 4096})
    tokenizer = AutoTokenizer.from_pretrained(folder)
    table: dict[str, dict[str, Any]] = {}
    for name in SERVERS:
        (work / name).mkdir()
        server = start(name, folder, args.port, work / name, args.vllm_python)
        try:
            table[name] = {**measure(server, tokenizer, args.tokens, args.requests), "settings": server.settings}
        finally:
            server.stop()
    ratios = {
        "vllm_tp2_over_tp1": table["vllm-tp2"]["ttft_p50_s"] / table["vllm-tp1"]["ttft_p50_s"],
        "pdserve_tp2_over_tp1": table["pdserve-tp2"]["ttft_p50_s"] / table["pdserve-tp1"]["ttft_p50_s"],
        "pdserve_tp2_over_tp1_threads2": table["pdserve-tp2"]["ttft_p50_s"]
        / table["pdserve-tp1-threads2"]["ttft_p50_s"],
        "pdserve_over_vllm_tp2": table["pdserve-tp2"]["ttft_p50_s"] / table["vllm-tp2"]["ttft_p50_s"],
    }
    for key, value in ratios.items():
        print(f"{key}: {value:.2f}")
    where = vv.machine()
    FIGURES.mkdir(exist_ok=True)
    record = {"date": datetime.date.today().isoformat(), "machine": where, "args": vars(args), "table": table}
    (FIGURES / "tp_vs_vllm.json").write_text(json.dumps({**record, "ratios": ratios}, indent=2, default=str))
    plot(table, FIGURES / "tp_vs_vllm.png", where)
    print(f"wrote {FIGURES / 'tp_vs_vllm.json'} and .png", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
