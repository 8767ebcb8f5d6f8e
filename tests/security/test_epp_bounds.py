"""The endpoint picker's port (gateway/ext_proc.py), probed as any pod the NetworkPolicy lets
through could: every bound holds per caller (issue #29 item 1), the gateway's own included.

- a flood of connections from one address is cut at that address's cap; another address is
  still picked for;
- one connection cannot open more streams than its HTTP/2 SETTINGS allow (so one address holds
  at most connections_per_peer × streams_per_connection of the server's streams);
- a stream that sends headers and then nothing is cut at the pick deadline;
- request bodies buffered across streams have one budget; a stream past it gets a 503, and what
  a stream held is given back when it ends, however it ends.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import grpc
import pytest
import pytest_asyncio
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from pdserve_common.auth import GATEWAY_ROLE, TokenTable, bearer_interceptors, token_digest
from pdserve_worker.gateway import ext_proc
from pdserve_worker.gateway.endpoint_picker import Candidate
from security import h2wire

pytestmark = pytest.mark.timing

MODEL = "m"
ROUTERS = [Candidate("10.0.0.1:8000", 0), Candidate("10.0.0.2:8000", 0)]
# RFC 9113 section 7: REFUSED_STREAM, or ENHANCE_YOUR_CALM (what gRPC core sends past the limit).
REFUSALS = {0x7, 0xB}
PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
LIMITS = ext_proc.PickerLimits(
    streams_per_connection=4, connections_per_peer=3, max_connections=64, pick_deadline_s=1.0, body_budget_bytes=1000
)


def headers() -> ep.ProcessingRequest:
    hdrs = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":path", raw_value=b"/v1/completions")])
    return ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=hdrs))


def body(raw: bytes, end: bool = True) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=raw, end_of_stream=end))


REQUEST = json.dumps({"model": MODEL, "prompt": "hello"}).encode()


GATEWAY_TOKEN = "the-gateways-token"
AUTHORIZED = (("authorization", f"Bearer {GATEWAY_TOKEN}"),)


@pytest_asyncio.fixture
async def picker():
    p = ext_proc.EndpointPicker(MODEL, lambda: ROUTERS, LIMITS)
    tokens = TokenTable()
    tokens.accept("ns/svc", {GATEWAY_ROLE: token_digest(GATEWAY_TOKEN)})
    running = await ext_proc.serve(p, "127.0.0.1", 0, tokens)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}", interceptors=bearer_interceptors(GATEWAY_TOKEN))
    try:
        yield p, running, ep_grpc.ExternalProcessorStub(channel)
    finally:
        await channel.close()
        await running.stop(0)


async def picked(stub) -> str:
    """One whole buffered request through the picker: the response's last phase."""
    answers = [a async for a in stub.Process(iter([headers(), body(REQUEST)]))]
    return answers[-1].WhichOneof("response")


def flood(port: int, source: str, count: int) -> list[socket.socket]:
    socks = []
    for _ in range(count):
        s = socket.socket()
        s.bind((source, 0))
        s.connect(("127.0.0.1", port))
        socks.append(s)
    return socks


def closed_by_server(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


@pytest.mark.asyncio
async def test_a_connection_flood_from_one_address_leaves_another_served(picker):
    p, running, stub = picker
    socks = await asyncio.to_thread(flood, running.port, "127.0.0.2", 20)
    try:
        cut = await asyncio.to_thread(lambda: [closed_by_server(s, 1.0) for s in socks])
        assert sum(1 for c in cut if not c) == LIMITS.connections_per_peer, cut  # the cap held, the rest cut
        assert running.front.counts.refused_peer == 20 - LIMITS.connections_per_peer
        assert await picked(stub) == "request_body"  # 127.0.0.1 is still served
    finally:
        for s in socks:
            s.close()


def open_streams(port: int, count: int) -> tuple[socket.socket, set[int]]:
    """One connection, `count` Process calls opened on it (headers only); the streams the server refused."""
    sock = h2wire.connect(f"127.0.0.1:{port}")
    ids = [1 + 2 * i for i in range(count)]
    sock.sendall(b"".join(h2wire.call_headers(i, PROCESS, AUTHORIZED) for i in ids))
    got, deadline = b"", time.monotonic() + 0.5  # well within the pick deadline
    sock.settimeout(0.05)
    while time.monotonic() < deadline:
        try:
            got += sock.recv(65536)
        except TimeoutError:
            pass
    refused = {
        sid
        for kind, _, sid, payload in h2wire.frames(got)
        if kind == h2wire.RST_STREAM and int.from_bytes(payload[:4], "big") in REFUSALS
    }
    return sock, refused


@pytest.mark.asyncio
async def test_one_connection_holds_no_more_streams_than_its_settings(picker):
    _, running, stub = picker
    sock, refused = await asyncio.to_thread(open_streams, running.port, LIMITS.streams_per_connection + 3)
    try:
        past = {1 + 2 * i for i in range(LIMITS.streams_per_connection, LIMITS.streams_per_connection + 3)}
        assert refused == past, refused  # exactly the streams past SETTINGS_MAX_CONCURRENT_STREAMS
        assert await picked(stub) == "request_body"
    finally:
        sock.close()


@pytest.mark.asyncio
async def test_a_stream_that_stalls_before_its_pick_is_cut(picker):
    _, _, stub = picker
    call = stub.Process()
    await call.write(headers())
    assert (await call.read()).WhichOneof("response") == "request_headers"  # CONTINUE, then nothing more
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call.read()
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < LIMITS.pick_deadline_s + 1.0


@pytest.mark.asyncio
async def test_bodies_share_one_budget_and_a_stream_gives_its_share_back(picker):
    p, _, stub = picker
    holder = stub.Process()
    await holder.write(headers())
    await holder.read()
    await holder.write(body(b"x" * 800, end=False))  # holds 800 of the 1,000 bytes
    await asyncio.sleep(0.2)
    assert p.buffered == 800
    answers = [a async for a in stub.Process(iter([headers(), body(b"y" * 300, end=False), body(b"", True)]))]
    assert answers[-1].immediate_response.status.code == 503 and b"picker_busy" in answers[-1].immediate_response.body
    holder.cancel()  # the holder goes away mid-body: its 800 bytes are free again
    deadline = time.monotonic() + 2.0
    while p.buffered and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert p.buffered == 0
    assert await picked(stub) == "request_body"
