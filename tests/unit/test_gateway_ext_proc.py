"""The endpoint picker (gateway/ext_proc.py) over the real ext_proc protocol: a gRPC client built
from Envoy's own stubs (xds-protos, envoy.service.ext_proc.v3) plays the gateway, as the Gateway
API Inference Extension's endpoint-picker protocol describes it: the pick comes back as the
`x-gateway-destination-endpoint` header mutation and the `envoy.lb` dynamic metadata key of
the same name; refusals are ImmediateResponses."""

from __future__ import annotations

import json

import grpc
import pytest
import pytest_asyncio
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from pdserve_worker.gateway import ext_proc
from pdserve_worker.gateway.endpoint_picker import Candidate, affinity_key, pick

MODEL = "SmolLM2-135M-Instruct"
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
ROUTERS = [Candidate(f"10.0.0.{i}:8000", in_flight=i % 3) for i in range(1, 6)]


def headers(end_of_stream: bool = False) -> ep.ProcessingRequest:
    pairs = [(":method", "POST"), (":path", "/v1/completions"), ("content-type", "application/json")]
    hdrs = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs])
    return ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=hdrs, end_of_stream=end_of_stream))


def body_parts(body: bytes, parts: int = 1) -> list[ep.ProcessingRequest]:
    step = max(1, -(-len(body) // parts))
    chunks = [body[i : i + step] for i in range(0, len(body), step)] or [b""]
    return [
        ep.ProcessingRequest(request_body=ep.HttpBody(body=c, end_of_stream=i == len(chunks) - 1))
        for i, c in enumerate(chunks)
    ]


@pytest_asyncio.fixture
async def gateway(port):
    """(stub, picker): the picker served on 127.0.0.1, a client as the gateway dials it."""
    routers = list(ROUTERS)
    picker = ext_proc.EndpointPicker(MODEL, lambda: routers)
    server = grpc.aio.server()
    ext_proc.add_to(server, picker)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield ep_grpc.ExternalProcessorStub(channel), picker, routers
    finally:
        await channel.close()
        await server.stop(0)


async def exchange(stub, requests: list[ep.ProcessingRequest]) -> list[ep.ProcessingResponse]:
    return [r async for r in stub.Process(iter(requests))]


def destination(response: ep.ProcessingResponse) -> tuple[str, str]:
    """(header, metadata) destinations of a routed response."""
    phase = response.WhichOneof("response")
    common = getattr(response, phase).response
    [option] = common.header_mutation.set_headers
    assert option.header.key == ext_proc.DESTINATION_HEADER and common.clear_route_cache
    meta = response.dynamic_metadata.fields[ext_proc.METADATA_NAMESPACE].struct_value
    return option.header.raw_value.decode(), meta.fields[ext_proc.DESTINATION_HEADER].string_value


@pytest.mark.asyncio
async def test_a_buffered_request_is_routed_to_the_pickers_choice_by_header_and_metadata(gateway):
    stub, picker, routers = gateway
    body = {"model": MODEL, "prompt": "Once upon a time " * 40, "max_tokens": 8}
    raw = json.dumps(body).encode()
    responses = await exchange(stub, [headers(), *body_parts(raw, parts=3)])
    assert [r.WhichOneof("response") for r in responses] == ["request_headers", "request_body"]
    assert not responses[0].request_headers.response.HasField("header_mutation")  # CONTINUE
    want = pick(routers, affinity_key(body)).address
    assert destination(responses[1]) == (want, want) and picker.picks == 1
    # The same prefix goes to the same router; the response phases pass untouched.
    again = {**body, "max_tokens": 99}
    tail = [ep.ProcessingRequest(response_headers=ep.HttpHeaders()), ep.ProcessingRequest(response_body=ep.HttpBody())]
    responses = await exchange(stub, [headers(), *body_parts(json.dumps(again).encode()), *tail])
    assert destination(responses[1])[0] == want
    assert [r.WhichOneof("response") for r in responses[2:]] == ["response_headers", "response_body"]


@pytest.mark.asyncio
async def test_full_duplex_streaming_routes_the_headers_then_hands_the_body_back(gateway):
    """FULL_DUPLEX_STREAMED, the mode the Inference Extension's gateways configure (announced in
    the first message's protocol_config): nothing is answered until the body ends; then the
    headers answer carries the route and one streamed body response returns the body unchanged."""
    stub, _, routers = gateway
    body = {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    raw = json.dumps(body).encode()
    first = headers()
    first.protocol_config.request_body_mode = FULL_DUPLEX
    responses = await exchange(stub, [first, *body_parts(raw, parts=4)])
    assert [r.WhichOneof("response") for r in responses] == ["request_headers", "request_body"]
    want = pick(routers, affinity_key(body)).address
    assert destination(responses[0]) == (want, want)
    streamed = responses[1].request_body.response.body_mutation.streamed_response
    assert streamed.body == raw and streamed.end_of_stream


@pytest.mark.asyncio
async def test_a_request_without_a_body_is_routed_on_its_headers(gateway):
    stub, _, routers = gateway
    [response] = await exchange(stub, [headers(end_of_stream=True)])
    assert response.WhichOneof("response") == "request_headers"
    assert destination(response)[0] == pick(routers, "").address


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "raw,status,code",
    [
        (b"{not json", 400, "invalid_json"),
        (b"[1, 2]", 400, "invalid_json"),
        (json.dumps({"model": "gpt-9", "prompt": "x"}).encode(), 404, "model_not_found"),
    ],
)
async def test_refusals_are_immediate_responses_in_openais_shape(gateway, raw, status, code):
    stub, picker, _ = gateway
    responses = await exchange(stub, [headers(), *body_parts(raw)])
    immediate = responses[-1].immediate_response
    assert immediate.status.code == status and immediate.details == code
    assert json.loads(immediate.body)["error"]["code"] == code and picker.picks == 0


@pytest.mark.asyncio
async def test_no_router_is_a_503_and_an_oversized_body_a_413(gateway, monkeypatch):
    stub, _, routers = gateway
    routers.clear()
    responses = await exchange(stub, [headers(), *body_parts(json.dumps({"prompt": "x"}).encode())])
    assert responses[-1].immediate_response.status.code == 503
    monkeypatch.setattr(ext_proc, "MAX_BODY_BYTES", 64)
    responses = await exchange(stub, [headers(), *body_parts(b"x" * 200, parts=4)])
    assert responses[-1].immediate_response.status.code == 413


@pytest.mark.asyncio
async def test_a_stream_the_gateway_breaks_leaves_the_picker_serving(gateway):
    stub, _, routers = gateway
    call = stub.Process()
    await call.write(headers())
    assert (await call.read()).WhichOneof("response") == "request_headers"
    call.cancel()  # the gateway gave up mid-request
    body = {"model": MODEL, "prompt": "hello"}
    responses = await exchange(stub, [headers(), *body_parts(json.dumps(body).encode())])
    assert destination(responses[-1])[0] == pick(routers, affinity_key(body)).address


def test_affinity_is_rendezvous_hashing_with_bounded_load():
    """Removing a router moves only the keys it had; a router past the load bound is skipped."""
    routers = [Candidate(f"10.0.0.{i}:8000") for i in range(8)]
    keys = [f"prefix {i}" for i in range(400)]
    before = {k: pick(routers, k).address for k in keys}
    assert len(set(before.values())) == 8  # every router gets some
    gone = routers[3].address
    after = {k: pick([r for r in routers if r.address != gone], k).address for k in keys}
    assert all(after[k] == before[k] for k in keys if before[k] != gone)
    busy = [Candidate(r.address, 50 if r.address == before[keys[0]] else 1) for r in routers]
    assert pick(busy, keys[0]).address != before[keys[0]]
    assert affinity_key({"messages": [{"role": "user", "content": "hi"}]}) == '[["user","hi"]]'
    assert len(affinity_key({"prompt": "x" * 5000})) == 1024
