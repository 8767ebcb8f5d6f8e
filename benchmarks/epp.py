"""The endpoint picker's decision latency (issue #34): how long a gateway waits for a pick.

Run:  PYTHONPATH=worker:common:proto python benchmarks/epp.py [--routers 100] [--requests 2000]

Three figures, medians and p99 over `--requests` requests with distinct 1,000-character prompts:
- the pick alone (gateway/endpoint_picker.py `pick`: bounded-load rendezvous hashing over
  `--routers` candidates with random in-flight counts);
- the server's decision on the body (parse the JSON, pick, build the routed answer);
- the whole ext_proc exchange as a gateway sees it: one `Process` stream over loopback gRPC
  (request_headers, then the buffered body; answered CONTINUE, then the routed body response),
  client stubs from Envoy's own protos (xds-protos), the picker serving in this process: on a
  bare gRPC server, and on the listener as deployed (ext_proc.serve: per-address front, limits).
Target: p50 ≤ 1 ms at 100 routers. Prints progress; writes benchmarks/figures/epp.json.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from pdserve_worker.gateway import ext_proc
from pdserve_worker.gateway.endpoint_picker import Candidate, affinity_key, pick
from pdserve_worker.util.free_ports import free_port

FIGURES = Path(__file__).resolve().parent / "figures"
MODEL = "SmolLM2-135M-Instruct"


def say(message: str) -> None:
    print(f"[epp {time.strftime('%H:%M:%S')}] {message}", flush=True)


def quantiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"p50_ms": statistics.median(ordered) * 1e3, "p99_ms": ordered[int(len(ordered) * 0.99) - 1] * 1e3}


class TimedPicker(ext_proc.EndpointPicker):
    """The picker, timing its decision on the body (parse, pick, build the answer)."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.decisions: list[float] = []

    def _from_body(self, raw: bytes, phase: str = "request_body") -> ep.ProcessingResponse:
        started = time.perf_counter()
        answer = super()._from_body(raw, phase)
        self.decisions.append(time.perf_counter() - started)
        return answer


async def exchanges(routers: list[Candidate], bodies: list[bytes], fronted: bool) -> tuple[list[float], list[float]]:
    """Each body's whole exchange; `fronted`: the listener as deployed (ext_proc.serve: the
    per-address front splicing each connection to the server, the per-caller limits), else a
    bare gRPC server (the protocol's own cost)."""
    picker = TimedPicker(MODEL, lambda: routers)
    running: ext_proc.PickerServer | None = None
    if fronted:
        running = await ext_proc.serve(picker, "127.0.0.1", 0)
        port = running.port
    else:
        port = free_port()
        server = grpc.aio.server()
        ext_proc.add_to(server, picker)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
    hdrs = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":path", raw_value=b"/v1/completions")])
    took = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = ep_grpc.ExternalProcessorStub(channel)
        for i, body in enumerate(bodies):
            requests = [
                ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=hdrs)),
                ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True)),
            ]
            started = time.perf_counter()
            replies = [r async for r in stub.Process(iter(requests))]
            took.append(time.perf_counter() - started)
            assert replies[-1].request_body.response.header_mutation.set_headers
            if (i + 1) % 500 == 0:
                say(f"exchanges {i + 1}/{len(bodies)}")
    if running is not None:
        await running.stop(0)
    else:
        await server.stop(0)
    return took, picker.decisions


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--routers", type=int, default=100)
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args(argv)
    rng = random.Random(0)
    routers = [Candidate(f"10.1.{i // 250}.{i % 250}:8000", rng.randrange(0, 20)) for i in range(args.routers)]
    bodies = [
        {"model": MODEL, "prompt": "".join(rng.choice("abcdefgh ") for _ in range(1000)), "max_tokens": 64}
        for _ in range(args.requests)
    ]
    say(f"pick alone: {args.requests} picks over {args.routers} routers")
    alone = []
    for body in bodies:
        started = time.perf_counter()
        pick(routers, affinity_key(body))
        alone.append(time.perf_counter() - started)
    raw = [json.dumps(b).encode() for b in bodies]
    say("the whole ext_proc exchange over loopback gRPC, bare server")
    whole, decisions = asyncio.run(exchanges(routers, raw, fronted=False))
    say("the same through the listener as deployed (per-address front, limits)")
    deployed, _ = asyncio.run(exchanges(routers, raw, fronted=True))
    summary = {
        "pick": quantiles(alone),
        "decision": quantiles(decisions),
        "exchange": quantiles(whole),
        "exchange_deployed": quantiles(deployed),
        "routers": args.routers,
        "requests": args.requests,
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.processor() or 'cpu'}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "load": os.getloadavg()[0],
    }
    FIGURES.mkdir(exist_ok=True)
    (FIGURES / "epp.json").write_text(json.dumps(summary, indent=1))
    print(
        f"{args.routers} routers: pick p50 {summary['pick']['p50_ms']:.3f} ms p99 {summary['pick']['p99_ms']:.3f} ms; "
        f"server's decision on the body p50 {summary['decision']['p50_ms']:.3f} ms p99 "
        f"{summary['decision']['p99_ms']:.3f} ms; "
        f"ext_proc exchange p50 {summary['exchange']['p50_ms']:.3f} ms p99 {summary['exchange']['p99_ms']:.3f} ms; "
        f"as deployed p50 {summary['exchange_deployed']['p50_ms']:.3f} ms "
        f"p99 {summary['exchange_deployed']['p99_ms']:.3f} ms (target p50 ≤ 1 ms)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
