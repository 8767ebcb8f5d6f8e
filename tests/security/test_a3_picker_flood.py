"""Issue #58 A3, against real processes (the session's `pdserve local`, router-0 serving the
endpoint picker): the picker needed no credential and parsed 8 MiB bodies on router-0's event
loop (its /health p99 went from 6 ms to 1.8 s), and 32 addresses filled its 256 connections.

Now a call without the gateway's token is refused from its headers, unread; a body the gateway
forwards (a tenant's: the gateway's token does not make it benign) is parsed off the loop only
when small, within a CPU budget, else routed by its first bytes (gateway/body_parse.py); and one
address holds a 256th of the connections. The attack: 8 MiB bodies of small numbers (over a
second of CPU each to parse), without a token and through the gateway, while connections are
held from 40 addresses. /health and another tenant's completions stay under 1 s at p99, and
the gateway is still picked for."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from pdserve_common.credentials import gateway_token
from security import h2wire
from security.conftest import EPP_PORT
from security.test_a1_grammar_flood import p99

pytestmark = [pytest.mark.slow, pytest.mark.timing]

PICKER = f"127.0.0.1:{EPP_PORT}"
CHUNK = 1 << 20  # the gateway streams a body in parts (each under gRPC's 4 MiB message bound)
HOLDERS, PER_HOLDER = 40, 8  # 320 connections: past the old 256 in all


def heavy_body(model: str) -> bytes:
    """Just under 8 MiB of JSON whose parse takes over a second: millions of small numbers."""
    return json.dumps({"model": model, "prompt": [0] * (4_000_000)}, separators=(",", ":")).encode()


def messages(body: bytes) -> list[ep.ProcessingRequest]:
    hdrs = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":path", raw_value=b"/v1/completions")])
    parts = [body[i : i + CHUNK] for i in range(0, len(body), CHUNK)]
    return [ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=hdrs))] + [
        ep.ProcessingRequest(request_body=ep.HttpBody(body=p, end_of_stream=i == len(parts) - 1))
        for i, p in enumerate(parts)
    ]


def process(stub, body: bytes, token: str | None) -> ep.ProcessingResponse | grpc.StatusCode:
    """One request through the picker: its last answer, or the call's status code."""
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    try:
        return list(stub.Process(iter(messages(body)), metadata=metadata, timeout=60))[-1]
    except grpc.RpcError as exc:
        return exc.code()


def hold_connections(stop: threading.Event, held: list[socket.socket]) -> None:
    """HTTP/2 connections from 40 loopback addresses (the preface sent, no call), held until `stop`."""
    for a in range(HOLDERS):
        for _ in range(PER_HOLDER):
            s = socket.socket()
            s.bind((f"127.0.1.{1 + a}", 0))
            try:
                s.connect(("127.0.0.1", EPP_PORT))
                s.sendall(h2wire.PREFACE + h2wire.settings(()))
            except OSError:
                s.close()
                continue
            held.append(s)
    stop.wait()


def test_a3_picker_flood_leaves_router_and_tenants_under_a_second(local):
    url = local.url
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    heavy, small = heavy_body(model), json.dumps({"model": model, "prompt": "hello"}).encode()
    gateway = gateway_token(local.token)
    done, stop_holding = threading.Event(), threading.Event()
    health: list[float] = []
    victims: list[float] = []
    held: list[socket.socket] = []

    def probe(path: str, out: list[float], body: dict | None) -> None:
        with httpx.Client(base_url=url, timeout=30) as http:
            while not done.is_set():
                started = time.monotonic()
                r = http.post(path, json=body) if body is not None else http.get(path)
                assert r.status_code == 200, r.text
                out.append(time.monotonic() - started)
                time.sleep(0.05)

    plain = {"model": model, "prompt": "hello", "max_tokens": 2, "temperature": 0}
    with (
        grpc.insecure_channel(PICKER) as anonymous,
        grpc.insecure_channel(PICKER) as trusted,
        ThreadPoolExecutor(10) as pool,
    ):
        intruder, gate = ep_grpc.ExternalProcessorStub(anonymous), ep_grpc.ExternalProcessorStub(trusted)
        assert process(gate, small, gateway).WhichOneof("response") == "request_body"  # (connected first)
        watchers = [pool.submit(probe, "/health", health, None), pool.submit(probe, "/v1/completions", victims, plain)]
        holder = pool.submit(hold_connections, stop_holding, held)
        try:
            time.sleep(0.5)
            floods = [pool.submit(process, intruder, heavy, None) for _ in range(4)]
            floods += [pool.submit(process, gate, heavy, gateway) for _ in range(2)]
            results = [f.result() for f in floods]
            time.sleep(0.5)
            # past the held connections, a gateway's new connection is still picked for
            with grpc.insecure_channel(PICKER) as fresh:
                late = process(ep_grpc.ExternalProcessorStub(fresh), small, gateway)
        finally:
            done.set()
            stop_holding.set()
            holder.result()
            for s in held:
                s.close()
        for w in watchers:
            w.result()
    assert len(health) >= 5 and len(victims) >= 3, (len(health), len(victims))
    assert p99(health) < 1.0, f"/health p99 {p99(health):.2f} s over {len(health)} probes"
    assert p99(victims) < 1.0, f"another tenant's p99 {p99(victims):.2f} s over {len(victims)} requests"
    assert results[:4] == [grpc.StatusCode.UNAUTHENTICATED] * 4, [str(r)[:40] for r in results[:4]]
    for answer in results[4:]:  # the tenant's heavy body, through the gateway: routed, unparsed
        assert not isinstance(answer, grpc.StatusCode) and answer.WhichOneof("response") == "request_body", answer
    assert not isinstance(late, grpc.StatusCode) and late.WhichOneof("response") == "request_body", late
