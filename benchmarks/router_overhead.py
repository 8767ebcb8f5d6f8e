"""What the router's HTTP front costs per request and per streamed token.

A backend that produces tokens instantly is served by the real router (uvicorn, in a child
process, as in a pod); a client streams answers over loopback. Baseline in the same run: the
same backend consumed in-process with no HTTP at all. Prints medians over repeated requests:

    request overhead  = latency of a 1-token non-streamed request (validation, tokenizing in a
                        thread, the disconnect watcher, JSON) vs. GET /health on the same server
    per-token cost    = streaming time per token through the router vs. in-process

Usage: python benchmarks/router_overhead.py [--tokens 256] [--repeats 15]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "worker"), str(ROOT / "operator"), str(ROOT / "proto")]

from pdserve_worker.model.sampling_params import SamplingParams  # noqa: E402
from pdserve_worker.roles.backend import TokenEvent  # noqa: E402


class InstantBackend:
    """One short word per token, no compute: whatever time is measured is the router's."""

    model_name = "instant"
    max_model_len = 1 << 20

    def tokenize_prompt(self, prompt: str) -> list[int]:
        return [ord(c) for c in prompt]

    def tokenize_chat(self, messages: list[dict]) -> list[int]:
        return self.tokenize_prompt("".join(m["content"] for m in messages))

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[TokenEvent]:
        for i in range(params.max_tokens):
            yield TokenEvent(i, " tok", "length" if i + 1 == params.max_tokens else None)
            await asyncio.sleep(0)  # yield to the loop as a real backend awaiting a decode step does


def serve(port: int) -> None:
    from pdserve_worker.roles.router_app import create_app
    from pdserve_worker.roles.router_server import serve_router

    serve_router(create_app(InstantBackend()), "127.0.0.1", port, grace_s=1)


def in_process_seconds(tokens: int) -> float:
    async def consume() -> None:
        async for _ in InstantBackend().generate([1], SamplingParams(max_tokens=tokens), "b"):
            pass

    start = time.perf_counter()
    asyncio.run(consume())
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        serve(args.serve)
        return

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PDSERVE_LOG_LEVEL": "WARNING"}
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port)], env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url, timeout=30) as client:
            for _ in range(200):
                try:
                    client.get("/health")
                    break
                except httpx.TransportError:
                    time.sleep(0.05)
            one, health, streamed, baseline = [], [], [], []
            for _ in range(args.repeats):
                start = time.perf_counter()
                client.get("/health")
                health.append(time.perf_counter() - start)
                start = time.perf_counter()
                r = client.post("/v1/completions", json={"model": "instant", "prompt": "x", "max_tokens": 1})
                one.append(time.perf_counter() - start)
                assert r.status_code == 200, r.text
                body = {"model": "instant", "prompt": "x", "max_tokens": args.tokens, "stream": True}
                start = time.perf_counter()
                with client.stream("POST", "/v1/completions", json=body) as r:
                    chunks = sum(1 for line in r.iter_lines() if line.startswith("data: {"))
                streamed.append(time.perf_counter() - start)
                assert chunks == args.tokens + 1, chunks  # one per token, then the finish chunk
                baseline.append(in_process_seconds(args.tokens))
    finally:
        server.terminate()
        server.wait(timeout=10)

    req_ms = statistics.median(one) * 1000
    health_ms = statistics.median(health) * 1000
    tok_router_us = statistics.median(streamed) / args.tokens * 1e6
    tok_base_us = statistics.median(baseline) / args.tokens * 1e6
    print(f"1-token completion: median {req_ms:.2f} ms; GET /health baseline {health_ms:.2f} ms; "
          f"router work {req_ms - health_ms:.2f} ms, ratio {req_ms / health_ms:.2f}x")
    print(f"per streamed token: router {tok_router_us:.1f} us, in-process baseline {tok_base_us:.1f} us, "
          f"ratio {tok_router_us / tok_base_us:.0f}x")
    print(f"router streaming ceiling: {1e6 / tok_router_us:,.0f} tokens/s per stream "
          f"(a CPU decode step of 10-40 ms is 10-40k us)")


if __name__ == "__main__":
    main()
