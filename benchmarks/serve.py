"""Serving under load: PD disaggregation against one colocated process, same requests, one run.

Each configuration is started with `pdserve local` machinery (real processes on 127.0.0.1,
the real default model) and gets the same request trace: Poisson arrivals, a mix of short
prompts and long ones (1-2k tokens), a fixed number of output tokens (ignore_eos, so every
request decodes the same amount). Measured at the client, as a user sees it:

    TTFT         arrival to first token (p50, p99)
    TPOT         a request's mean time per output token after the first (p50, p99 over requests)
    ITL          gaps between consecutive tokens of a request (p50, p99 over all gaps): where a
                 decode step waited for someone else's prefill, the gap shows it whole
    throughput   output tokens per second from the first arrival to the last answer

Interference ratio = decode p99 colocated ÷ disaggregated (1 prefill + 1 decode), for TPOT
and ITL: how much the arriving long prompts slow the tokens of requests already decoding
when prefill and decode share one process, compared with separate processes.

Layer sharding (`pd1s2`: 1 prefill + one decode group of 2 processes, each with half the
layers) against `pd2` (1 prefill + 2 unsharded decodes), the same 3 model processes: the ratio
line shows what passing the hidden state between processes costs per token and what half the
decode instances cost in throughput; the gain a group buys (KV pools per layer range, so longer
contexts or bigger models per device) does not show on one CPU host.

CPU budget: every configuration gets the same CPUs. Colocated: one process with every
thread; PD: each model process gets its share (`pdserve local` divides them).

Mixed trace (`--mixed`): the router's admission queue against immediate 429s with client
retries, on one PD deployment shape (1 prefill + 1 decode, few slots) started twice with API
keys: an *interactive* tenant (short prompts, Poisson arrivals, priority high) and a *batch*
tenant (long prompts, bursts, priority low). `queue` is the default router; `retry429` runs
the router without a queue (`PDSERVE_ADMISSION_QUEUE=0`): a request that finds no free slot is
answered 429 with Retry-After, and the client sleeps that long and tries again, as the openai
client does. Goodput = requests that met their class's SLO (TTFT, measured from the first
send, retries included) per second of the trace.

Multi-turn trace (`--multiturn`, issue #16): conversations that share one 1,500-token
system prompt, each turn extending the conversation before it (its question and the answer it
got), served by 1 prefill + 1 decode with the prefill's prefix cache off and on; TTFT p50 of
the requests whose prefix was seen before (every request but the first), cache on ÷ off.
Then 2 prefills + 1 decode, prefix cache on, 4 distinct system prompts interleaved: the share
of repeat requests (system prompt seen before) that land on a prefill that served it before,
and the busiest prefill's requests ÷ the least busy's.

Usage: python benchmarks/serve.py [--requests 32] [--rate 0.5] [--configs pd1,pd2,pd1s2,colocated]
       python benchmarks/serve.py --mixed [--duration 40]
       python benchmarks/serve.py --multiturn [--conversations 4 --turns 3] [--sequential]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "worker"), str(ROOT / "operator"), str(ROOT / "common"), str(ROOT / "proto")]

import httpx  # noqa: E402

from pdserve_worker.cli.local_deployment import LocalDeployment  # noqa: E402
from pdserve_worker.cli.local_plan import LocalPlan  # noqa: E402

CONFIGS = {
    "pd1": dict(prefill=1, decode=1),
    "pd2": dict(prefill=1, decode=2),
    # 1 prefill + one decode group of 2 layer-sharded processes: as many model processes as pd2.
    "pd1s2": dict(prefill=1, decode=1, layer_shards=2),
    "colocated": dict(colocated=True),
    # The multi-turn trace: the prefill's prefix cache off and on; 2 prefills for prefix routing.
    "pd1-nocache": dict(prefill=1, decode=1, prefix_cache_tokens=0),
    "pd1-cache": dict(prefill=1, decode=1, prefix_cache_tokens=16_384),
    "pd2p-cache": dict(prefill=2, decode=1, prefix_cache_tokens=16_384),
}
WORDS = (
    "the model reads a prompt and writes an answer one token at a time while the cache of keys and values "
    "grows with every step of the decoder on the machine in the cluster of servers"
).split()


@dataclass(frozen=True)
class Request:
    at: float  # seconds after the start of the trace
    prompt: str
    prompt_tokens: int
    group: int = 0  # multi-turn: which system prompt
    seen: bool = False  # multi-turn: an earlier request of the trace shares its system prompt


@dataclass
class Result:
    request: Request
    sent: float = 0.0
    token_times: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    error: str | None = None
    retries: int = 0  # 429s the client slept on and retried
    cached_tokens: int = 0
    prefill: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.sent if self.token_times else None

    @property
    def tpot(self) -> float | None:
        if len(self.token_times) < 2 or self.completion_tokens < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (self.completion_tokens - 1)

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


def make_trace(
    n: int, rate: float, long_fraction: float, short: tuple[int, int], long: tuple[int, int], tokenizer, seed: int
) -> list[Request]:
    """Poisson arrivals; prompt lengths uniform in `short` or (with `long_fraction`) in `long`."""
    rng = random.Random(seed)
    at, trace = 0.0, []
    for _ in range(n):
        at += rng.expovariate(rate)
        lo, hi = long if rng.random() < long_fraction else short
        target = rng.randint(lo, hi)
        words = [rng.choice(WORDS) for _ in range(target)]
        ids = tokenizer.encode(" ".join(words))[:target]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        trace.append(Request(at, text, len(tokenizer.encode(text))))
    return trace


async def one(
    http: httpx.AsyncClient,
    url: str,
    model: str,
    request: Request,
    output_tokens: int,
    start: float,
    headers: dict[str, str] | None = None,
    extra: dict[str, Any] | None = None,
) -> Result:
    await asyncio.sleep(max(0.0, start + request.at - time.monotonic()))
    result = Result(request, sent=time.monotonic())
    body = {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": output_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }
    headers = {"x-pdserve-debug": "workers", **(headers or {})}  # the answer names its prefill
    while True:
        try:
            async with http.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as response:
                if response.status_code == 429:  # no free slot anywhere: the client retries
                    result.retries += 1
                    await asyncio.sleep(float(response.headers.get("retry-after-ms", 500)) / 1000)
                    continue
                if response.status_code != 200:
                    result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                    return result
                async for line in response.aiter_lines():
                    if not line.startswith("data:") or line.endswith("[DONE]"):
                        continue
                    chunk = json.loads(line[5:])
                    if chunk.get("usage"):
                        result.completion_tokens = chunk["usage"]["completion_tokens"]
                        result.cached_tokens = (chunk["usage"].get("prompt_tokens_details") or {}).get(
                            "cached_tokens", 0
                        )
                    if chunk.get("pdserve"):
                        result.prefill = chunk["pdserve"].get("prefill") or result.prefill
                    if any(c.get("text") for c in chunk.get("choices") or []):
                        result.token_times.append(time.monotonic())
            return result
        except httpx.HTTPError as exc:
            result.error = repr(exc)
            return result


async def drive(
    url: str, trace: list[Request], output_tokens: int, sequential: bool = False
) -> tuple[list[Result], float]:
    """Replay `trace` at its arrival times, or (`sequential`) each request once the one before
    it was answered: TTFT then holds no queueing, only the request's own prefill."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0, connect=10.0)) as http:
        model = (await http.get(f"{url}/v1/models")).json()["data"][0]["id"]
        # One warm-up request: first-call costs (allocator, lazy imports) are not the load's.
        warm = Request(0.0, "hello there", 2)
        await one(http, url, model, warm, 4, time.monotonic())
        start = time.monotonic()
        if sequential:
            results = [await one(http, url, model, r, output_tokens, time.monotonic() - r.at) for r in trace]
        else:
            results = await asyncio.gather(*(one(http, url, model, r, output_tokens, start) for r in trace))
        return list(results), time.monotonic() - start


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def summarize(name: str, results: list[Result], wall_s: float) -> dict[str, float]:
    ok = [r for r in results if r.error is None and r.token_times]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    gaps = [g for r in ok for g in r.gaps]
    tokens = sum(r.completion_tokens for r in ok)
    return {
        "config": name,
        "ok": len(ok),
        "failed": len(results) - len(ok),
        "ttft_p50": pct(ttft, 50),
        "ttft_p99": pct(ttft, 99),
        "tpot_p50": pct(tpot, 50),
        "tpot_p99": pct(tpot, 99),
        "itl_p50": pct(gaps, 50),
        "itl_p99": pct(gaps, 99),
        "tok_per_s": tokens / wall_s if wall_s else 0.0,
        "wall_s": wall_s,
    }


def run_config(name: str, args: argparse.Namespace, trace: list[Request]) -> dict[str, float]:
    return summarize(name, *run_trace(name, args, trace))


def run_trace(
    name: str, args: argparse.Namespace, trace: list[Request], sequential: bool = False
) -> tuple[list[Result], float]:
    plan = LocalPlan(
        port=0, dtype=args.dtype, slots=args.slots, max_len=args.max_len, threads=args.threads, **CONFIGS[name]
    )
    print(f"[{name}] starting ...", file=sys.stderr, flush=True)
    with LocalDeployment(plan, progress=None) as deployment:
        url = deployment.start(timeout_s=600)
        results, wall = asyncio.run(drive(url, trace, args.output_tokens, sequential))
    for r in results:
        if r.error:
            print(f"[{name}] request failed: {r.error}", file=sys.stderr)
    return results, wall


def words(rng: random.Random, tokenizer, count: int) -> str:
    ids = tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(count)))[:count]
    return tokenizer.decode(ids, skip_special_tokens=True)


def make_multiturn_trace(
    tokenizer, seed: int, systems: int, conversations: int, turns: int, rate: float, system_tokens: int = 1500
) -> list[Request]:
    """`conversations` conversations over `systems` system prompts of `system_tokens` tokens
    (assigned in turn, so systems interleave), each of `turns` turns; turn k's prompt is turn
    k-1's prompt, a stand-in for its answer and a new question (it extends the one before).
    Turns arrive in rounds (every conversation's turn 1, then every turn 2, ...), conversations
    shuffled within a round, Poisson gaps."""
    rng = random.Random(seed)
    heads = [f"System {g}: " + words(rng, tokenizer, system_tokens) for g in range(systems)]
    convs = [heads[c % systems] for c in range(conversations)]
    at, trace, seen = 0.0, [], set()
    for _ in range(turns):
        order = list(range(conversations))
        rng.shuffle(order)
        for c in order:
            convs[c] += " Answer: " + words(rng, tokenizer, 24) + " Question: " + words(rng, tokenizer, 40)
            at += rng.expovariate(rate)
            group = c % systems
            trace.append(Request(at, convs[c], len(tokenizer.encode(convs[c])), group, group in seen))
            seen.add(group)
    return trace


def multiturn(args: argparse.Namespace, tokenizer) -> int:
    one = make_multiturn_trace(tokenizer, args.seed, 1, args.conversations, args.turns, args.rate)
    seq = args.sequential
    lengths = [r.prompt_tokens for r in one]
    print(
        f"multi-turn: {len(one)} requests, 1 system prompt of 1,500 tokens, {args.conversations} conversations x "
        f"{args.turns} turns, prompts {min(lengths)}-{max(lengths)} tokens, {args.output_tokens} output tokens"
    )
    off, off_wall = run_trace("pd1-nocache", args, one, seq)
    on, on_wall = run_trace("pd1-cache", args, one, seq)
    failed = sum(r.error is not None for r in off + on)
    ttft_off = pct([r.ttft for r in off if r.request.seen and r.ttft is not None], 50)
    ttft_on = pct([r.ttft for r in on if r.request.seen and r.ttft is not None], 50)
    cached = sum(r.cached_tokens for r in on) / max(1, sum(r.request.prompt_tokens for r in on))
    for name, rows, wall in (("cache off", off, off_wall), ("cache on", on, on_wall)):
        row = summarize(name, rows, wall)
        print(
            f"  {name:<9} TTFT p50 (prefix seen) {pct([r.ttft for r in rows if r.request.seen and r.ttft], 50):.2f}s "
            f"TTFT p50 all {row['ttft_p50']:.2f}s  TPOT p50 {row['tpot_p50'] * 1e3:.1f}ms"
        )
    print(
        f"  TTFT p50 of repeat-prefix requests, cache on / off: {ttft_on / ttft_off:.2f} (target <= 0.3); "
        f"prompt tokens from the cache: {cached:.0%}"
    )

    four = make_multiturn_trace(
        tokenizer,
        args.seed + 1,
        4,
        max(8, args.conversations * 2),
        args.turns,
        args.rate,
        system_tokens=args.routing_system_tokens,
    )
    routed, _ = run_trace("pd2p-cache", args, four, seq)
    failed += sum(r.error is not None for r in routed)
    holders: dict[int, set[str]] = {}
    hits = repeats = 0
    served: dict[str, int] = {}
    for r in routed:  # in arrival order: the trace is ordered
        if r.prefill is None:
            continue
        served[r.prefill] = served.get(r.prefill, 0) + 1
        if r.request.seen:
            repeats += 1
            hits += r.prefill in holders.get(r.request.group, set())
        holders.setdefault(r.request.group, set()).add(r.prefill)
    counts = sorted(served.values())
    balance = counts[-1] / counts[0] if len(counts) > 1 and counts[0] else float("inf")
    print(
        f"  2 prefills, 4 system prompts of {args.routing_system_tokens} tokens, {len(four)} requests: repeat requests on a prefill holding their "
        f"prefix {hits}/{repeats} = {hits / max(1, repeats):.0%} (target >= 90%); requests per prefill "
        f"{served} (busiest / least busy {balance:.2f}, target <= 2)"
    )
    return 1 if failed else 0


# ---- mixed trace: admission queue against 429 + retries --------------------------------------------

MIXED_KEYS = {"interactive": "sk-bench-interactive-0123456789", "batch": "sk-bench-batch-0123456789abc"}
MIXED_CONFIGS = {"queue": {}, "retry429": {"PDSERVE_ADMISSION_QUEUE": "0"}}


@dataclass(frozen=True)
class MixedClass:
    name: str  # the tenant, too
    priority: str
    output_tokens: int
    slo_ttft_s: float


def make_mixed_trace(args: argparse.Namespace, tokenizer) -> list[tuple[MixedClass, Request]]:
    """Interactive: Poisson arrivals of short prompts. Batch: bursts of long prompts."""
    rng = random.Random(args.seed)
    interactive = MixedClass("interactive", "high", args.interactive_tokens, args.interactive_slo)
    batch = MixedClass("batch", "low", args.batch_tokens, args.batch_slo)

    def prompt(lo: int, hi: int, at: float) -> Request:
        target = rng.randint(lo, hi)
        ids = tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(target)))[:target]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        return Request(at, text, len(tokenizer.encode(text)))

    trace: list[tuple[MixedClass, Request]] = []
    at = 0.0
    while True:
        at += rng.expovariate(args.interactive_rate)
        if at >= args.duration:
            break
        trace.append((interactive, prompt(32, 128, at)))
    burst_at = 1.0
    while burst_at < args.duration:
        trace += [(batch, prompt(*args.batch_prompt, burst_at + 0.01 * i)) for i in range(args.batch_burst)]
        burst_at += args.batch_every
    return sorted(trace, key=lambda item: item[1].at)


async def drive_mixed(
    url: str, trace: list[tuple[MixedClass, Request]]
) -> tuple[list[tuple[MixedClass, Result]], float]:
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(900.0, connect=10.0), limits=httpx.Limits(max_connections=1000)
    ) as http:
        auth = {name: {"Authorization": f"Bearer {key}"} for name, key in MIXED_KEYS.items()}
        model = (await http.get(f"{url}/v1/models", headers=auth["interactive"])).json()["data"][0]["id"]
        await one(http, url, model, Request(0.0, "hello there", 2), 4, time.monotonic(), auth["interactive"])
        start = time.monotonic()
        results = await asyncio.gather(
            *(
                one(
                    http,
                    url,
                    model,
                    request,
                    cls.output_tokens,
                    start,
                    {**auth[cls.name], "x-pdserve-priority": cls.priority},
                )
                for cls, request in trace
            )
        )
        return list(zip((cls for cls, _ in trace), results)), time.monotonic() - start


def run_mixed(name: str, args: argparse.Namespace, trace: list[tuple[MixedClass, Request]], keys: Path) -> dict:
    plan = LocalPlan(
        port=0,
        dtype=args.dtype,
        slots=args.slots,
        max_len=args.max_len,
        threads=args.threads,
        prefill=1,
        decode=1,
        api_keys=keys,
        extra_env=MIXED_CONFIGS[name],
    )
    print(f"[{name}] starting ...", file=sys.stderr, flush=True)
    with LocalDeployment(plan, progress=None) as deployment:
        url = deployment.start(timeout_s=300)
        results, wall = asyncio.run(drive_mixed(url, trace))
    span = max(args.duration, 1e-9)
    row: dict = {"config": name, "wall_s": wall}
    for cls_name in MIXED_KEYS:
        mine = [(c, r) for c, r in results if c.name == cls_name]
        ok = [r for c, r in mine if r.error is None and r.ttft is not None]
        good = [r for c, r in mine if r.error is None and r.ttft is not None and r.ttft <= c.slo_ttft_s]
        ttft = [r.ttft for r in ok]
        row[cls_name] = {
            "n": len(mine),
            "ok": len(ok),
            "good": len(good),
            "retries": sum(r.retries for _, r in mine),
            "ttft_p50": pct(ttft, 50),
            "ttft_p99": pct(ttft, 99),
        }
    row["goodput"] = sum(row[c]["good"] for c in MIXED_KEYS) / span
    for c, r in results:
        if r.error:
            print(f"[{name}] {c.name} request failed: {r.error}", file=sys.stderr)
    return row


def main_mixed(args: argparse.Namespace, tokenizer, model: str) -> int:
    import tempfile

    trace = make_mixed_trace(args, tokenizer)
    counts = {c: sum(1 for k, _ in trace if k.name == c) for c in MIXED_KEYS}
    cpus = len(os.sched_getaffinity(0))
    print(
        f"{time.strftime('%Y-%m-%d')} {model} {args.dtype}; {platform.machine()}, {cpus} CPUs; mixed trace over "
        f"{args.duration:.0f}s: {counts['interactive']} interactive (priority high, {args.interactive_rate}/s, "
        f"32-128 prompt tokens, {args.interactive_tokens} out, SLO TTFT <= {args.interactive_slo:g}s) + "
        f"{counts['batch']} batch (priority low, bursts of {args.batch_burst} every {args.batch_every:g}s, "
        f"{args.batch_prompt[0]}-{args.batch_prompt[1]} prompt tokens, {args.batch_tokens} out, SLO TTFT <= {args.batch_slo:g}s); 1 prefill + 1 decode, "
        f"{args.slots} slots"
    )
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys.yaml"
        keys.write_text(
            "tenants:\n" + "".join(f'  - name: {name}\n    keys: ["{key}"]\n' for name, key in MIXED_KEYS.items())
        )
        rows = [run_mixed(name, args, trace, keys) for name in args.configs.split(",")]
    print(
        f"\n{'config':<10} {'class':<12} {'n':>4} {'ok':>4} {'in SLO':>7} {'429s':>6} {'TTFT p50':>9} {'TTFT p99':>9}"
    )
    for row in rows:
        for cls_name in MIXED_KEYS:
            c = row[cls_name]
            print(
                f"{row['config']:<10} {cls_name:<12} {c['n']:>4} {c['ok']:>4} {c['good']:>7} {c['retries']:>6} "
                f"{c['ttft_p50']:>8.2f}s {c['ttft_p99']:>8.2f}s"
            )
        print(f"{row['config']:<10} goodput {row['goodput']:.2f} requests in SLO per second")
    by = {r["config"]: r for r in rows}
    if "queue" in by and "retry429" in by and by["retry429"]["goodput"] > 0:
        q, r = by["queue"], by["retry429"]
        print(
            f"\ngoodput queue ÷ 429+retry: {q['goodput'] / r['goodput']:.2f}x; interactive in SLO "
            f"{q['interactive']['good']}/{q['interactive']['n']} vs {r['interactive']['good']}/{r['interactive']['n']}"
        )
    return 1 if any(row[c]["ok"] < row[c]["n"] for row in rows for c in MIXED_KEYS) else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--rate", type=float, default=0.4, help="mean arrivals per second (Poisson)")
    parser.add_argument("--long-fraction", type=float, default=0.35, help="share of prompts of 1-2k tokens")
    parser.add_argument("--output-tokens", type=int, default=24)
    parser.add_argument("--configs", default="pd1,pd2,colocated")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32"],
        help="auto: bfloat16 where the CPU has native bf16 matmul, else float32",
    )
    parser.add_argument("--slots", type=int, default=16, help="KV slots per decode (and for colocated)")
    parser.add_argument("--max-len", type=int, default=2304)
    parser.add_argument("--threads", type=int, default=0, help="torch threads per model process (0: CPUs shared)")
    parser.add_argument("--seed", type=int, default=0)
    mixed = parser.add_argument_group("mixed trace (--mixed): admission queue against 429 + client retries")
    mixed.add_argument("--mixed", action="store_true")
    mixed.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    mixed.add_argument("--interactive-rate", type=float, default=0.25)
    mixed.add_argument("--interactive-tokens", type=int, default=16)
    mixed.add_argument("--interactive-slo", type=float, default=5.0, help="TTFT SLO of interactive requests, s")
    mixed.add_argument("--batch-burst", type=int, default=4)
    mixed.add_argument("--batch-every", type=float, default=20.0)
    mixed.add_argument("--batch-tokens", type=int, default=64)
    mixed.add_argument(
        "--batch-prompt",
        type=int,
        nargs=2,
        default=(64, 128),
        metavar=("MIN", "MAX"),
        help="prompt tokens of batch requests",
    )
    mixed.add_argument("--batch-slo", type=float, default=60.0, help="TTFT SLO of batch requests, s")
    parser.add_argument(
        "--multiturn", action="store_true", help="the multi-turn trace: the prefix cache and prefix routing"
    )
    parser.add_argument("--conversations", type=int, default=4, help="multiturn: conversations per system prompt run")
    parser.add_argument("--turns", type=int, default=3, help="multiturn: turns per conversation")
    parser.add_argument(
        "--sequential",
        action="store_true",
        help="multiturn: each request after the one before was answered (no queueing in TTFT)",
    )
    parser.add_argument(
        "--routing-system-tokens",
        type=int,
        default=1500,
        help="multiturn: system prompt length of the 4-prompt routing trace",
    )
    args = parser.parse_args()
    if args.mixed:
        if args.configs == parser.get_default("configs"):
            args.configs = ",".join(MIXED_CONFIGS)
        if args.slots == parser.get_default("slots"):
            args.slots = 2  # few slots: the slots, not the prefill, are what requests wait for
        if args.max_len == parser.get_default("max_len"):
            args.max_len = 1024

    from pdserve_worker.model.loading.loader import model_folder
    from pdserve_worker.model.tokenizer import Tokenizer

    if args.dtype == "auto":
        from pdserve_worker.cli.local_deployment import auto_dtype

        args.dtype = auto_dtype()
    folder, model = model_folder(None, args.dtype)
    tokenizer = Tokenizer.from_dir(folder)
    if args.mixed:
        return main_mixed(args, tokenizer, model)
    if args.multiturn:
        print(
            f"{time.strftime('%Y-%m-%d')} {model} {args.dtype}; {platform.machine()}, "
            f"{len(os.sched_getaffinity(0))} CPUs"
        )
        return multiturn(args, tokenizer)
    trace = make_trace(args.requests, args.rate, args.long_fraction, (32, 256), (1024, 2048), tokenizer, args.seed)
    lengths = [r.prompt_tokens for r in trace]
    cpus = len(os.sched_getaffinity(0))
    print(
        f"{time.strftime('%Y-%m-%d')} {model} {args.dtype}; {platform.machine()}, {cpus} CPUs; "
        f"{len(trace)} requests at {args.rate}/s over {trace[-1].at:.0f}s, prompts {min(lengths)}-{max(lengths)} "
        f"tokens ({sum(n >= 1024 for n in lengths)} of 1k+), {args.output_tokens} output tokens each"
    )
    rows = [run_config(name, args, trace) for name in args.configs.split(",")]

    print(
        f"\n{'config':<10} {'ok':>3} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} "
        f"{'ITL p50':>8} {'ITL p99':>8} {'tok/s':>7}"
    )
    for r in rows:
        print(
            f"{r['config']:<10} {r['ok']:>3} {r['ttft_p50']:>8.2f}s {r['ttft_p99']:>8.2f}s "
            f"{r['tpot_p50'] * 1e3:>7.1f}ms {r['tpot_p99'] * 1e3:>7.1f}ms {r['itl_p50'] * 1e3:>6.1f}ms "
            f"{r['itl_p99'] * 1e3:>6.1f}ms {r['tok_per_s']:>7.1f}"
        )
    by = {r["config"]: r for r in rows}
    if "colocated" in by and "pd1" in by:
        c, d = by["colocated"], by["pd1"]
        print(
            f"\ninterference ratio (colocated ÷ 1 prefill + 1 decode): TPOT p99 {c['tpot_p99'] / d['tpot_p99']:.1f}x, "
            f"ITL p99 {c['itl_p99'] / d['itl_p99']:.1f}x (target >= 3)"
        )
    if "pd1s2" in by and "pd2" in by:
        g, d = by["pd1s2"], by["pd2"]
        print(
            f"layer-sharded group ÷ 2 unsharded decodes (1 prefill each): TPOT p50 {g['tpot_p50'] / d['tpot_p50']:.2f}x, "
            f"TTFT p50 {g['ttft_p50'] / d['ttft_p50']:.2f}x, throughput {g['tok_per_s'] / d['tok_per_s']:.2f}x"
        )
    failed = sum(r["failed"] for r in rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
