"""Draining a decode with requests in flight: live migration against re-prefill resume and
waiting for the requests to finish (issue #17), one run.

Each mode is one `pdserve local` deployment (1 prefill, 2 decodes, real processes on
127.0.0.1) whose decodes drain the given way (`PDSERVE_DRAIN_MODE`):

    migrate   the drain hands each request over: its KV is pushed to the other decode, which
              goes on at the next token (no prefill)
    resume    the drain ends each stream at once; the router re-prefills prompt + streamed
              tokens on the other decode (what happened before #17 once the drain timed out)
    wait      the drain waits until every request finished (the behaviour before #17)

Same trace in each: decode-1's slots are held while N streams start, so all run on decode-0;
once each stream has K tokens, decode-1 is freed and decode-0 drained through its admin port
(the pod's preStop). Measured: how long the drain call took (what holds a scale-down), and the
largest gap between two tokens a client saw from the drain on (its p50 and max over the
streams), against the mean inter-token gap of the same streams before the drain (SSE chunks
that arrive in one read count as gaps of 0); prefill calls made during the
drain call and until the streams ended (the prefill's counter); every text compared with the wait run's (undisturbed).

Usage: PYTHONPATH=worker:operator:proto python benchmarks/migrate.py [--model builtin:smollm2]
       [--dtype auto] [--weights auto] [--streams 6] [--max-tokens 256] [--prompt-words 300] [--modes wait,migrate,resume,wait]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import platform
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from pdserve.v1 import worker_pb2, worker_pb2_grpc  # noqa: E402
from support.local_run import LocalRun  # noqa: E402  (the tests' way of running `pdserve local`)

SLOTS = 8
WORDS = (
    "river stone light garden window morning paper music orange silver market winter "
    "bridge forest story engine letter mountain ocean candle"
).split()


@dataclass
class Stream:
    text: str = ""
    arrivals: list[float] = field(default_factory=list)
    info: dict = field(default_factory=dict)
    error: str | None = None


def prompts(n: int, words: int) -> list[str]:
    return [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(words)) + f" Chapter {i}:" for i in range(n)]


def run_stream(url: str, model: str, prompt: str, seed: int | None, max_tokens: int, out: Stream) -> None:
    sampling = {"temperature": 0.8, "top_p": 0.95, "seed": seed} if seed is not None else {"temperature": 0}
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True, **sampling}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as reply:
        if reply.status_code != 200:
            out.error = f"HTTP {reply.status_code}"
            return
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                out.text += choice.get("text", "")
                out.arrivals.append(time.monotonic())
            out.info = chunk.get("pdserve", out.info)


def scrape(address: str, name: str) -> float:
    text = httpx.get(f"http://{address}/metrics", timeout=10).text
    match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def one_mode(mode: str, args: argparse.Namespace, work: Path) -> dict:
    run = LocalRun.start(
        work / mode,
        "--model",
        args.model,
        "--dtype",
        args.dtype,
        "--weights",
        args.weights,
        "--prefill",
        "1",
        "--decode",
        "2",
        "--slots",
        str(SLOTS),
        "--max-len",
        str(args.max_len),
        "--port",
        "0",
        "--env",
        f"PDSERVE_DRAIN_MODE={mode}",
        "--env",
        "PDSERVE_DRAIN_TIMEOUT_SECONDS=600",
        timeout_s=600,
    )
    try:
        model = httpx.get(f"{run.url}/v1/models", timeout=10).json()["data"][0]["id"]
        meta = (("authorization", f"Bearer {run.token}"),)
        channel = grpc.insecure_channel(run.child("decode-1")["grpc"])
        decode1 = worker_pb2_grpc.DecodeStub(channel)
        held = [
            decode1.Reserve(
                worker_pb2.ReserveRequest(request_id=f"hold-{i}", num_prompt_tokens=4, max_tokens=4, lease_ms=600_000),
                metadata=meta,
                timeout=10,
            )
            for i in range(SLOTS)
        ]
        texts = prompts(args.streams, args.prompt_words)
        seeds = [None if i < args.streams - 2 else 100 + i for i in range(args.streams)]
        streams = [Stream() for _ in texts]
        with concurrent.futures.ThreadPoolExecutor(len(texts)) as pool:
            futures = [
                pool.submit(run_stream, run.url, model, p, s, args.max_tokens, st)
                for p, s, st in zip(texts, seeds, streams)
            ]
            while not all(len(s.arrivals) >= args.drain_after for s in streams):
                if any(f.done() for f in futures):
                    raise RuntimeError(f"{mode}: a stream ended before the drain: {[s.error for s in streams]}")
                time.sleep(0.005)
            for g in held:
                decode1.Release(
                    worker_pb2.ReleaseRequest(
                        request_id=g.request_id, slot=g.slot, generation=g.generation, push_settled=True
                    ),
                    metadata=meta,
                    timeout=10,
                )
            prefill_http = run.child("prefill-0")["http"]
            prefills = scrape(prefill_http, "pdserve_prefill_request_seconds_count")
            drain_started = time.monotonic()
            drained = run.drain("decode-0", timeout_s=900)
            drain_s = time.monotonic() - drain_started
            prefills_during = scrape(prefill_http, "pdserve_prefill_request_seconds_count") - prefills
            for f in futures:
                f.result()
            prefills_after = scrape(prefill_http, "pdserve_prefill_request_seconds_count") - prefills
        channel.close()
    finally:
        run.stop(timeout_s=120)
    before, worst = [], []
    for s in streams:
        gaps = [(b - a, b) for a, b in zip(s.arrivals, s.arrivals[1:])]
        before += [g for g, end in gaps if end < drain_started]
        worst.append(max(g for g, end in gaps if end >= drain_started))  # the gaps from the drain on
    return {
        "mode": mode,
        "drained": drained.get("drained"),
        "drain_s": drain_s,
        "prefills": prefills_during,
        "prefills_after": prefills_after,
        "itl_before_ms": 1000 * statistics.fmean(before),
        "gap_p50_ms": 1000 * statistics.median(worst),
        "gap_max_ms": 1000 * max(worst),
        "texts": [s.text for s in streams],
        "migrations": sum(bool(s.info.get("migrations")) for s in streams),
        "errors": [s.error for s in streams if s.error],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin:smollm2")
    p.add_argument(
        "--dtype",
        default="auto",
        help="auto (default, as `pdserve local`): bf16 where the CPU has it natively, else fp32",
    )
    p.add_argument(
        "--weights",
        default="auto",
        help="auto (default, as `pdserve local`): the GGUF's matrices stay int4/int8, a route whose "
        "logits are bitwise the same whatever batch a request runs in, so seeded texts compare "
        "across schedules; `dequantized` in bf16 is not (the GEMM's kernel depends on the batch's row "
        "count), and a batch's composition alone can then flip a token",
    )
    p.add_argument("--streams", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--prompt-words", type=int, default=300)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--drain-after", type=int, default=16, help="tokens every stream has when the drain starts")
    p.add_argument(
        "--modes",
        default="wait,migrate,resume,wait",
        help="the first wait run is the reference; a second one is the control (deployment to deployment)",
    )
    args = p.parse_args()
    print(
        f"# {time.strftime('%Y-%m-%d')} {platform.processor() or platform.machine()} python {platform.python_version()}"
        f"; model {args.model} {args.dtype} weights {args.weights}, {args.streams} streams x {args.max_tokens} tokens, prompts of ~{args.prompt_words} "
        f"words, drain after {args.drain_after} tokens"
    )
    results = []
    with tempfile.TemporaryDirectory(prefix="pdserve-migrate-bench-") as tmp:
        for mode in args.modes.split(","):
            results.append(one_mode(mode, args, Path(tmp)))
            r = results[-1]
            print(
                f"{mode}: drain {r['drain_s']:.2f}s, largest gap p50 {r['gap_p50_ms']:.0f} ms / max "
                f"{r['gap_max_ms']:.0f} ms, ITL before {r['itl_before_ms']:.1f} ms, prefills during drain "
                f"{r['prefills']:.0f} (until the end {r['prefills_after']:.0f}), migrated {r['migrations']}, errors {r['errors']}",
                flush=True,
            )
    base = next((r for r in results if r["mode"] == "wait"), results[0])
    for r in results:
        if r is not base:
            differ = [i for i, (a, b) in enumerate(zip(r["texts"], base["texts"])) if a != b]
            where = {
                i: next((j for j, (x, y) in enumerate(zip(r["texts"][i], base["texts"][i])) if x != y), None)
                for i in differ
            }
            print(
                f"{r['mode']}: streams whose text differs from the first wait run: {differ} "
                f"(first differing character: {where}; streams {args.streams - 2}.. are the seeded ones)"
            )
    print(
        "\n| drain mode | drain call | largest gap a client saw (p50 / max over streams) | ITL before | "
        "prefill calls during the drain call / until the streams ended | text = undisturbed |"
    )
    print("|---|---|---|---|---|---|")
    for r in results:
        same = sum(a == b for a, b in zip(r["texts"], base["texts"]))
        print(
            f"| {r['mode']} | {r['drain_s']:.2f} s | {r['gap_p50_ms']:.0f} / {r['gap_max_ms']:.0f} ms | "
            f"{r['itl_before_ms']:.1f} ms | {r['prefills']:.0f} / {r['prefills_after']:.0f} | {same}/{len(r['texts'])} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
