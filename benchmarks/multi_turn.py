#!/usr/bin/env python3
"""#55's multi-turn rows: decode-side prefix reuse against the push of every turn whole.

8 conversations at once, each of 4 turns: turn 1 is a 1,000-token history and a question; turn
k's prompt is turn k-1's prompt, the answer the server gave (its text) and 100 new tokens. Every
configuration is `pdserve local` with 1 prefill and 2 decodes on the same model and cores:

  always-nodecode  --disaggregation always, PDSERVE_DECODE_PREFIX_CACHE=0 (the baseline: the
                   prefill's own prefix cache only, every turn's KV pushed whole)
  always-nodecode-again  the baseline once more: whether its own greedy text repeats under the
                   same concurrency (bf16 steps of other batch sizes round differently)
  always           --disaggregation always, decode prefix cache on (its prompts' blocks: push the rest)
  auto             --disaggregation auto, decode prefix cache on (the default)
  auto-answers     auto, and the decode keeps its answers' blocks too (PDSERVE_DECODE_PREFIX_ANSWERS=1)

Reported per configuration, over turns 2-4: the KV bytes pushed (the answer's `pdserve` field)
and TTFT p50, as ratios to the baseline's, and whether every answer's text (temperature 0) is
the baseline's. `--rounds N` repeats everything and reports medians with each round's ratio.

  python benchmarks/multi_turn.py [--rounds 3] [--out benchmarks/figures/multi_turn.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "worker"), str(ROOT / "common"), str(ROOT / "proto")]

import serve  # noqa: E402  (benchmarks/serve.py: the word list)
import vs_vllm  # noqa: E402  (the shared weights and `pdserve local` starter)

CONFIGS = {
    "always-nodecode": ["--disaggregation", "always", "--env", "PDSERVE_DECODE_PREFIX_CACHE=0"],
    "always-nodecode-again": ["--disaggregation", "always", "--env", "PDSERVE_DECODE_PREFIX_CACHE=0"],
    "always": ["--disaggregation", "always"],
    "auto": ["--disaggregation", "auto"],
    "auto-answers": ["--disaggregation", "auto", "--env", "PDSERVE_DECODE_PREFIX_ANSWERS=1"],
}
BASELINE = "always-nodecode"


@dataclass
class Turn:
    conversation: int
    turn: int
    prompt_tokens: int = 0
    ttft: float | None = None
    kv_bytes: int = 0
    cached: int = 0
    disaggregated: bool | None = None
    decode: str | None = None
    text: str = ""
    error: str | None = None


@dataclass
class Conversation:
    history: str
    questions: list[str]
    turns: list[Turn] = field(default_factory=list)


def words(tokenizer: Any, rng: random.Random, count: int) -> str:
    ids = tokenizer.encode(" ".join(rng.choice(serve.WORDS) for _ in range(count + 8)))[:count]
    return tokenizer.decode(ids, skip_special_tokens=True)


def conversations(tokenizer: Any, args: argparse.Namespace) -> list[Conversation]:
    rng = random.Random(args.seed)
    return [
        Conversation(
            f"Conversation {c}. " + words(tokenizer, rng, args.history_tokens),
            [" Question: " + words(tokenizer, rng, args.new_tokens) for _ in range(args.turns)],
        )
        for c in range(args.conversations)
    ]


async def ask(http: httpx.AsyncClient, url: str, model: str, prompt: str, turn: Turn, output_tokens: int) -> str:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.monotonic()
    async with http.stream("POST", f"{url}/v1/completions", json=body, headers={"x-pdserve-debug": "workers"}) as reply:
        if reply.status_code != 200:
            turn.error = f"HTTP {reply.status_code}: {(await reply.aread())[:200]!r}"
            return ""
        async for line in reply.aiter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                turn.prompt_tokens = chunk["usage"]["prompt_tokens"]
                turn.cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            if chunk.get("pdserve"):
                info = chunk["pdserve"]
                turn.kv_bytes, turn.decode = info.get("kv_bytes", 0), info.get("decode")
                turn.disaggregated = info.get("disaggregated")
            for choice in chunk.get("choices") or []:
                if choice.get("text") and turn.ttft is None:
                    turn.ttft = time.monotonic() - sent
                turn.text += choice.get("text", "")
    return turn.text


async def talk(url: str, model: str, conv: Conversation, index: int, output_tokens: int) -> None:
    prompt = conv.history
    async with httpx.AsyncClient(timeout=600) as http:
        for k, question in enumerate(conv.questions):
            prompt += question
            turn = Turn(index, k + 1)
            conv.turns.append(turn)
            answer = await ask(http, url, model, prompt, turn, output_tokens)
            prompt += answer


def run_config(name: str, folder: Path, args: argparse.Namespace, tokenizer: Any, logs: Path) -> list[Conversation]:
    extra = ["--prefill", "1", "--decode", "2", *CONFIGS[name]]
    server = vs_vllm.start_pdserve(name, str(folder), args.dtype, args.port, logs, extra)
    try:
        model = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
        warm = Conversation("Warm up. " + words(tokenizer, random.Random(1), 200), [" Question: hello"])
        asyncio.run(talk(server.url, model, warm, -1, 4))
        convs = conversations(tokenizer, args)
        started = time.perf_counter()

        async def all_at_once() -> None:
            await asyncio.gather(*(talk(server.url, model, c, i, args.output_tokens) for i, c in enumerate(convs)))

        asyncio.run(all_at_once())
        print(
            f"#   {name}: {sum(len(c.turns) for c in convs)} turns in {time.perf_counter() - started:.1f} s", flush=True
        )
        return convs
    finally:
        server.stop()


def later_turns(convs: list[Conversation]) -> list[Turn]:
    return [t for c in convs for t in c.turns if t.turn >= 2]


def summarize(convs: list[Conversation], baseline: list[Conversation]) -> dict[str, Any]:
    later = later_turns(convs)
    ttfts = [t.ttft for t in later if t.ttft is not None]
    same = all(a.text == b.text for c, d in zip(convs, baseline) for a, b in zip(c.turns, d.turns))
    return {
        "kv_bytes_turns_2_4": sum(t.kv_bytes for t in later),
        "ttft_p50_turns_2_4": statistics.median(ttfts) if ttfts else None,
        "cached_share_turns_2_4": sum(t.cached for t in later) / max(1, sum(t.prompt_tokens for t in later)),
        "local_turns": sum(t.disaggregated is False for t in later),
        "same_decode_turns": sum(t.decode == c.turns[t.turn - 2].decode for c in convs for t in c.turns if t.turn >= 2),
        "errors": sum(t.error is not None for c in convs for t in c.turns),
        "text_identical_to_baseline": same,
        "prompt_tokens": [t.prompt_tokens for t in convs[0].turns],
    }


def plot(report: dict[str, Any], path: Path) -> bool:
    """Each configuration's ratios to the baseline, a dot per round and a bar at the median, with
    the issue's bars (needs matplotlib: pip install -e '.[plots]')."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["ratios"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (key, label, bar) in zip(
        axes, (("kv_bytes", "KV bytes pushed, turns 2-4", 0.25), ("ttft_p50", "TTFT p50, turns 2-4", 0.5))
    ):
        values = [report["ratios"][n][key] for n in names]
        ax.bar(range(len(names)), [statistics.median(v) for v in values], color="#8fb3d9")
        for i, v in enumerate(values):
            ax.scatter([i] * len(v), v, color="black", s=12, zorder=3)
        ax.axhline(bar, color="red", linestyle="--", linewidth=1, label=f"bar {bar}x")
        ax.set_xticks(range(len(names)), names, fontsize=8, rotation=20, ha="right")
        ax.set_title(f"{label}, ÷ {BASELINE}", fontsize=9)
        ax.legend(fontsize=8)
    fig.suptitle(f"multi-turn, 1P2D, {report['machine']}, {report['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--history-tokens", type=int, default=1000)
    parser.add_argument("--new-tokens", type=int, default=100)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seed", type=int, default=55)
    parser.add_argument("--port", type=int, default=18655)
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "pdserve-vs-vllm")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "figures" / "multi_turn.json")
    args = parser.parse_args(argv)
    args.cache.mkdir(parents=True, exist_ok=True)
    folder = vs_vllm.hf_folder(args.dtype, args.cache)  # (shared with vs_vllm.py)
    from pdserve_worker.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(folder)
    logs = args.cache / "multi_turn_logs"
    logs.mkdir(exist_ok=True)
    rounds: list[dict[str, dict[str, Any]]] = []
    for r in range(args.rounds):
        print(f"# round {r + 1}/{args.rounds}", flush=True)
        runs = {name: run_config(name, folder, args, tokenizer, logs) for name in CONFIGS}
        rounds.append({name: summarize(convs, runs[BASELINE]) for name, convs in runs.items()})
        for name, row in rounds[-1].items():
            print(f"#   {name}: {json.dumps(row)}", flush=True)
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": vs_vllm.machine(),
        "cpu_flags": sorted({f for f in Path("/proc/cpuinfo").read_text().split() if f.startswith(("avx", "amx"))}),
        "args": {k: str(v) for k, v in vars(args).items()},
        "rounds": rounds,
    }
    print(f"\nmulti-turn, {args.conversations} conversations x {args.turns} turns, 1P2D, {args.rounds} round(s)")
    print("config            KV bytes t2-4 / baseline (rounds)   TTFT p50 t2-4 / baseline (rounds)   text same")
    for name in CONFIGS:
        kv = [rd[name]["kv_bytes_turns_2_4"] / max(1, rd[BASELINE]["kv_bytes_turns_2_4"]) for rd in rounds]
        tt = [rd[name]["ttft_p50_turns_2_4"] / rd[BASELINE]["ttft_p50_turns_2_4"] for rd in rounds]
        same = all(rd[name]["text_identical_to_baseline"] for rd in rounds)
        report.setdefault("ratios", {})[name] = {"kv_bytes": kv, "ttft_p50": tt}
        print(
            f"{name:<17} {statistics.median(kv):.3f} ({', '.join(f'{x:.3f}' for x in kv)})"
            f"{'':>8}{statistics.median(tt):.2f} ({', '.join(f'{x:.2f}' for x in tt)}){'':>12}{same}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    if plot(report, args.out.with_suffix(".png")):
        print(f"wrote {args.out.with_suffix('.png')}")
    return 1 if any(row["errors"] for rd in rounds for row in rd.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
