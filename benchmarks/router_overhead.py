"""What the router's HTTP front costs per request and per streamed token.

A backend that produces tokens instantly is served by the real router (uvicorn, in a child
process, as in a pod); a client streams answers over loopback. Baseline in the same run: the
same backend consumed in-process with no HTTP at all. Prints medians over repeated requests:

    request overhead  = latency of a 1-token non-streamed request (validation, tokenizing in a
                        thread, the disconnect watcher, JSON) vs. GET /health on the same server
    per-token cost    = streaming time per token through the router vs. in-process

Tracing: a second router with tracing on (sampling 1.0, spans exported as JSON lines to a
temporary file; needs the tracing extra) is measured in the same run, its requests interleaved
with the first one's, so "off vs on" shares the machine's load.

Usage: python benchmarks/router_overhead.py [--tokens 256] [--repeats 15] [--no-tracing]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "worker"), str(ROOT / "operator"), str(ROOT / "common"), str(ROOT / "proto")]

from pdserve_worker.api.backend import Backend, TokenEvent  # noqa: E402
from pdserve_worker.model.sampling.params import SamplingParams  # noqa: E402


class InstantBackend(Backend):
    """One short word per token, no compute: whatever time is measured is the router's."""

    model_name = "instant"
    max_model_len = 1 << 20

    def tokenize_prompt(self, prompt: str) -> list[int]:
        return [ord(c) for c in prompt]

    def tokenize_chat(self, messages: list[dict]) -> list[int]:
        return self.tokenize_prompt("".join(m["content"] for m in messages))

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str, *, cache_scope: str
    ) -> AsyncIterator[TokenEvent]:
        for i in range(params.max_tokens):
            yield TokenEvent(i, " tok", "length" if i + 1 == params.max_tokens else None)
            await asyncio.sleep(0)  # yield to the loop as a real backend awaiting a decode step does


def serve(port: int) -> None:
    from pdserve_common import tracing
    from pdserve_worker.api.app import create_app
    from pdserve_worker.api.server import build_router_server

    tracing.setup("pdserve-router", "bench", edge=True)  # on when PDSERVE_TRACE_FILE is set (the traced router)
    # uvicorn drains on SIGTERM, then re-raises it: ignored then, so the spans still get flushed.
    signal.signal(signal.SIGTERM, lambda sig, frame: None)
    try:
        build_router_server(create_app(InstantBackend()), "127.0.0.1", port, grace_s=1).run()
    finally:
        tracing.shutdown()


def in_process_seconds(tokens: int) -> float:
    async def consume() -> None:
        async for _ in InstantBackend().generate([1], SamplingParams(max_tokens=tokens), "b", cache_scope=""):
            pass

    start = time.perf_counter()
    asyncio.run(consume())
    return time.perf_counter() - start


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Router:
    """One router child process and its measurements."""

    def __init__(self, name: str, extra_env: dict[str, str]) -> None:
        import httpx

        self.name = name
        self.port = free_port()
        env = {**os.environ, "PDSERVE_LOG_LEVEL": "WARNING", **extra_env}
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", str(self.port)], env=env)
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=30)
        self.one: list[float] = []
        self.health: list[float] = []
        self.streamed: list[float] = []

    def wait_ready(self) -> None:
        import httpx

        for _ in range(400):
            try:
                self.client.get("/health")
                return
            except httpx.TransportError:
                time.sleep(0.05)
        raise RuntimeError(f"router {self.name} did not start")

    def measure_once(self, tokens: int) -> None:
        start = time.perf_counter()
        self.client.get("/health")
        self.health.append(time.perf_counter() - start)
        start = time.perf_counter()
        r = self.client.post("/v1/completions", json={"model": "instant", "prompt": "x", "max_tokens": 1})
        self.one.append(time.perf_counter() - start)
        assert r.status_code == 200, r.text
        body = {"model": "instant", "prompt": "x", "max_tokens": tokens, "stream": True}
        start = time.perf_counter()
        with self.client.stream("POST", "/v1/completions", json=body) as r:
            chunks = sum(1 for line in r.iter_lines() if line.startswith("data: {"))
        self.streamed.append(time.perf_counter() - start)
        assert chunks == tokens + 1, chunks  # one per token, then the finish chunk

    def close(self) -> None:
        self.client.close()
        self.proc.terminate()
        self.proc.wait(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--no-tracing", action="store_true", help="measure only the router without tracing")
    parser.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        serve(args.serve)
        return

    import tempfile

    from pdserve_common import tracing

    spans = Path(tempfile.mkdtemp(prefix="pdserve-bench-")) / "spans.jsonl"
    routers = [Router("tracing off", {})]
    if not args.no_tracing:
        if not tracing.available():
            raise SystemExit(
                "the tracing comparison needs the tracing extra (pip install 'pdserve[tracing]'), or pass --no-tracing"
            )
        routers.append(
            Router(
                "tracing on (sampling 1.0)", {"PDSERVE_TRACE_FILE": str(spans), "PDSERVE_TRACING_SAMPLE_RATIO": "1.0"}
            )
        )
    baseline: list[float] = []
    try:
        for router in routers:
            router.wait_ready()
        for _ in range(args.repeats):
            for router in routers:  # interleaved: both see the same load
                router.measure_once(args.tokens)
            baseline.append(in_process_seconds(args.tokens))
    finally:
        for router in routers:
            router.close()

    tok_base_us = statistics.median(baseline) / args.tokens * 1e6
    results = {}
    for router in routers:
        req_ms = statistics.median(router.one) * 1000
        health_ms = statistics.median(router.health) * 1000
        tok_router_us = statistics.median(router.streamed) / args.tokens * 1e6
        results[router.name] = (req_ms, tok_router_us)
        print(
            f"[{router.name}] 1-token completion: median {req_ms:.2f} ms; GET /health baseline {health_ms:.2f} ms; "
            f"router work {req_ms - health_ms:.2f} ms, ratio {req_ms / health_ms:.2f}x"
        )
        print(
            f"[{router.name}] per streamed token: router {tok_router_us:.1f} us, in-process baseline "
            f"{tok_base_us:.1f} us, ratio {tok_router_us / tok_base_us:.0f}x; streaming ceiling "
            f"{1e6 / tok_router_us:,.0f} tokens/s per stream"
        )
    if len(results) == 2:
        (off_req, off_tok), (on_req, on_tok) = results.values()
        lines = spans.read_text().splitlines() if spans.exists() else []
        print(
            f"tracing on vs off: 1-token completion {on_req / off_req:.3f}x ({on_req - off_req:+.2f} ms), "
            f"per streamed token {on_tok / off_tok:.3f}x ({on_tok - off_tok:+.1f} us); "
            f"{len(lines)} spans exported"
        )


if __name__ == "__main__":
    main()
