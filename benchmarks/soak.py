"""Soak: requests through `pdserve local` while random faults hit its processes (loopback only).

    PYTHONPATH=worker:operator:common:proto:tests python benchmarks/soak.py --requests 60 --seconds 120

Starts broker, 2 decode, 2 prefill and a router (a tiny random-weight model unless --model)
with `--on-exit restart`, records each prompt's undisturbed greedy answer, then streams
`--requests` requests (a 429 is retried after its Retry-After, as the OpenAI client does) (`--concurrency` at a time) while every `--fault-every` seconds one
random fault is injected by PID: a decode or a prefill killed (SIGKILL), a prefill frozen
for a few seconds (SIGSTOP/SIGCONT), or the broker killed. Bounded by `--seconds`.

Prints requests completed / failed / retried, answers that differ from the undisturbed run,
tokens lost (must be 0) and decode slots leaked once everything settled (must be 0); exits 1
if either is not 0. The baseline is the same deployment's undisturbed answers, in the same run.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from pdserve.v1 import worker_pb2, worker_pb2_grpc  # noqa: E402
from support.local_run import LocalRun, pid_alive, served_model  # noqa: E402  (the tests' way of running `pdserve local`)

PROMPTS = [
    "The quick brown fox",
    "Paris is the capital of",
    "A language model predicts",
    "Berlin is",
    "Numbers like 12345 and",
    "Unicode text: café, naïve,",
]


@dataclass
class Answer:
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0
    retries: int = 0
    error: str | None = None
    retry_after_s: float = 1.0


@dataclass
class Tally:
    completed: int = 0
    failed: int = 0
    retried: int = 0
    differing: int = 0
    tokens_lost: int = 0
    errors: list[str] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)


class Deployment:
    """`pdserve local` as the tests run it (tests/support/local_run.py), plus the faults' handles."""

    def __init__(self, model: str, log_dir: Path, slots: int, max_len: int) -> None:
        self.run = LocalRun.start(
            log_dir,
            "--model",
            model,
            "--dtype",
            "float32",
            "--prefill",
            "2",
            "--decode",
            "2",
            "--slots",
            str(slots),
            "--max-len",
            str(max_len),
            "--layers-per-chunk",
            "1",
            "--port",
            "0",
            "--threads",
            "1",
            "--on-exit",
            "restart",
            "--env",
            "PDSERVE_READINESS_TIMEOUT_MS=3000",
            "--env",
            "PDSERVE_TRANSFER_TIMEOUT_MS=2000",
        )
        self.url = self.run.url
        self.model = served_model(self.url)
        self.seen_pids: set[int] = set()

    def child(self, name: str) -> dict:
        return self.run.child(name)

    def signal(self, name: str, sig: int) -> None:
        pid = self.child(name)["pid"]
        self.seen_pids.add(pid)
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    def decode_status(self, name: str) -> worker_pb2.DecodeStatus | None:
        with grpc.insecure_channel(self.child(name)["grpc"]) as channel:
            try:
                return worker_pb2_grpc.DecodeStub(channel).Status(
                    worker_pb2.StatusRequest(), metadata=(("authorization", f"Bearer {self.run.token}"),), timeout=2
                )
            except grpc.RpcError:
                return None

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).json()["members"] == {"prefill": 2, "decode": 2}
        except (httpx.HTTPError, KeyError, ValueError):
            return False

    def stop(self) -> list[int]:
        """Stop; returns the PIDs of children still alive afterwards (must be none)."""
        self.seen_pids.update(c["pid"] for c in self.run.manifest["children"])
        self.run.stop(90)
        return [pid for pid in self.seen_pids if pid_alive(pid)]


def complete(d: Deployment, prompt: str, max_tokens: int, tries: int = 8) -> Answer:
    """One request as the OpenAI client sends it: a 429 is retried after its Retry-After."""
    for _ in range(tries - 1):
        answer = _complete_once(d, prompt, max_tokens)
        if not (answer.error or "").startswith("HTTP 429"):
            return answer
        time.sleep(answer.retry_after_s)
    return _complete_once(d, prompt, max_tokens)


def _complete_once(d: Deployment, prompt: str, max_tokens: int) -> Answer:
    body = {
        "model": d.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    answer = Answer()
    try:
        with httpx.stream("POST", f"{d.url}/v1/completions", json=body, timeout=120) as reply:
            if reply.status_code != 200:
                answer.retry_after_s = float(reply.headers.get("retry-after", "1"))
                answer.error = f"HTTP {reply.status_code}: {reply.read().decode()[:200]}"
                return answer
            for line in reply.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    answer.error = str(chunk["error"])[:200]
                for choice in chunk.get("choices", []):
                    answer.text += choice.get("text", "")
                    answer.finish_reason = choice.get("finish_reason") or answer.finish_reason
                if chunk.get("usage"):
                    answer.completion_tokens = chunk["usage"]["completion_tokens"]
                answer.retries = chunk.get("pdserve", {}).get("retries", answer.retries)
    except httpx.HTTPError as exc:
        answer.error = repr(exc)
    return answer


def inject_faults(d: Deployment, every_s: float, stop: threading.Event, rng: random.Random, tally: Tally) -> None:
    while not stop.wait(every_s):
        if not d.healthy():  # let the last fault heal first: one fault at a time
            continue
        fault = rng.choice(["kill decode", "kill prefill", "freeze prefill", "kill broker"])
        name = {"kill decode": f"decode-{rng.randrange(2)}", "kill broker": "broker"}.get(
            fault, f"prefill-{rng.randrange(2)}"
        )
        tally.faults.append(f"{fault} ({name})")
        if fault == "freeze prefill":
            d.signal(name, signal.SIGSTOP)
            stop.wait(4.0)
            d.signal(name, signal.SIGCONT)
        else:
            d.signal(name, signal.SIGKILL)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=120)
    ap.add_argument("--fault-every", type=float, default=4.0, help="seconds between faults")
    ap.add_argument("--seconds", type=float, default=180.0, help="time bound of the faulty phase")
    ap.add_argument("--model", default=None, help="HF folder (default: a tiny random-weight model)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="pdserve-soak-"))
    model = args.model
    if model is None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/support, without PYTHONPATH
        from support.tiny_model import write_tiny_model

        model = str(write_tiny_model(work / "tiny-model"))
    (work / "logs").mkdir()
    d = Deployment(model, work / "logs", slots=4, max_len=256)
    tally = Tally()
    leaked = -1
    try:
        reference = {p: complete(d, p, args.max_tokens) for p in PROMPTS}
        bad = [p for p, a in reference.items() if a.error or a.completion_tokens != args.max_tokens]
        if bad:
            raise SystemExit(f"undisturbed run failed for {bad}: {[reference[p].error for p in bad]}")
        stop = threading.Event()
        faults = threading.Thread(target=inject_faults, args=(d, args.fault_every, stop, rng, tally), daemon=True)
        started = time.monotonic()
        faults.start()
        prompts = [rng.choice(PROMPTS) for _ in range(args.requests)]
        with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
            futures = {}
            for p in prompts:
                if time.monotonic() - started > args.seconds:
                    break
                futures[pool.submit(complete, d, p, args.max_tokens)] = p
                while sum(not f.done() for f in futures) >= args.concurrency:
                    time.sleep(0.02)
            for future, prompt in futures.items():
                a = future.result()
                if a.error is not None:
                    tally.failed += 1
                    tally.errors.append(a.error)
                    continue
                tally.completed += 1
                tally.retried += a.retries > 0
                tally.tokens_lost += max(0, args.max_tokens - a.completion_tokens)
                tally.differing += a.text != reference[prompt].text
        stop.set()
        faults.join()
        faulty_s = time.monotonic() - started
        # Settle: restarted children back, quarantined slots back (readiness 3 s + transfer 2 s + 5 s).
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            statuses = [d.decode_status(f"decode-{i}") for i in range(2)]
            if d.healthy() and all(s is not None for s in statuses):
                leaked = sum(s.slots_total - s.slots_free for s in statuses)  # type: ignore[union-attr]
                if leaked == 0:
                    break
            time.sleep(0.5)
    finally:
        alive = d.stop()
    print(f"faulty phase: {faulty_s:.0f} s, {len(tally.faults)} faults: {', '.join(tally.faults)}")
    print(
        f"requests completed {tally.completed} / failed {tally.failed} / retried {tally.retried} "
        f"(of {tally.completed + tally.failed})"
    )
    print(f"answers differing from the undisturbed run: {tally.differing}")
    print(f"tokens lost: {tally.tokens_lost}")
    print(f"slots leaked: {leaked}")
    print(f"processes left running: {len(alive)}")
    for e in tally.errors[:5]:
        print(f"  failure: {e}")
    return 0 if tally.tokens_lost == 0 and tally.differing == 0 and leaked == 0 and not alive else 1


if __name__ == "__main__":
    sys.exit(main())
