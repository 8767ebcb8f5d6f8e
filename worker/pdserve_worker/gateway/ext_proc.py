"""The endpoint-picker side of Envoy's ext_proc protocol, as the Gateway API Inference Extension
specifies it: a gateway streams each request to us and routes it where we say (docs/gateway.md).

Per request, one `Process` stream (Envoy's own stubs, `envoy.service.ext_proc.v3`), in either
body mode: FULL_DUPLEX_STREAMED (headers answered routed at the body's end, the body handed back
unchanged as one streamed body response) or BUFFERED (headers answered CONTINUE, the body's
answer carries the route). A request without a body is picked on its headers. The body (at most
`MAX_BODY_BYTES`) names the model, which must be ours, and the prompt gives the affinity key
(gateway/endpoint_picker.py). The route is set as the `x-gateway-destination-endpoint` header
and the `envoy.lb` metadata key of that name. Refusals are `ImmediateResponse`s in OpenAI's
error shape: 400 not a JSON object, 404 another model, 413 over the bound, 503 no router ready.
Callers present the gateway's token, checked from the headers (#58 A3); bodies are parsed off
the loop (gateway/body_parse.py); `PickerLimits` bounds connections, streams, time, bodies.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from pdserve_common.auth import GATEWAY_ROLE, ServiceAuthInterceptor, TLSConfig, TokenTable
from pdserve_common.logs import kv
from pdserve_worker.gateway.body_parse import BodyParser, InvalidBody, ParseLimits, Unparsed
from pdserve_worker.gateway.endpoint_picker import AFFINITY_CHARS, Candidate, affinity_key, pick

log = logging.getLogger(__name__)

DESTINATION_HEADER = "x-gateway-destination-endpoint"
METADATA_NAMESPACE = "envoy.lb"
MAX_BODY_BYTES = 8 << 20  # the router's own body limit (PDSERVE_MAX_BODY_BYTES' default)
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"


@dataclass(frozen=True)
class PickerLimits:
    """What the picker's port lets any one caller hold (module docstring)."""

    max_streams: int = 1024  # concurrent streams, the whole server (one per request the gateway has in flight)
    streams_per_connection: int = 32  # HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS; a gateway opens more connections
    # One address holds a 256th of the connections (#58 A3: 8 of 256 let 32 addresses fill it),
    # and 128 streams: a gateway's pods are several addresses.
    connections_per_peer: int = 4
    max_connections: int = 1024
    idle_timeout_ms: int = 60_000  # a connection with no call is closed (a caller without the token makes none)
    pick_deadline_s: float = 30.0  # from a stream's first message to its pick (headers and whole body)
    body_budget_bytes: int = 256 << 20  # request bodies buffered across all streams
    parse: ParseLimits = ParseLimits()


def _error(status: int, message: str, code: str) -> ep.ProcessingResponse:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}})
    return ep.ProcessingResponse(
        immediate_response=ep.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=ep.HeaderMutation(
                set_headers=[
                    base_pb2.HeaderValueOption(
                        header=base_pb2.HeaderValue(key="content-type", raw_value=b"application/json")
                    )
                ]
            ),
            body=body.encode(),
            details=code,
        )
    )


def _routed(address: str, phase: str) -> ep.ProcessingResponse:
    """The answer that sends the request to `address`, in the `phase` it answers."""
    common = ep.CommonResponse(
        header_mutation=ep.HeaderMutation(
            set_headers=[
                base_pb2.HeaderValueOption(
                    header=base_pb2.HeaderValue(key=DESTINATION_HEADER, raw_value=address.encode())
                )
            ]
        ),
        clear_route_cache=True,
    )
    metadata = struct_pb2.Struct()
    metadata.update({METADATA_NAMESPACE: {DESTINATION_HEADER: address}})
    if phase == "request_headers":
        return ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=common), dynamic_metadata=metadata)
    return ep.ProcessingResponse(request_body=ep.BodyResponse(response=common), dynamic_metadata=metadata)


_CONTINUE = {
    "request_headers": ep.ProcessingResponse(request_headers=ep.HeadersResponse()),
    "response_headers": ep.ProcessingResponse(response_headers=ep.HeadersResponse()),
    "response_body": ep.ProcessingResponse(response_body=ep.BodyResponse()),
    "request_trailers": ep.ProcessingResponse(request_trailers=ep.TrailersResponse()),
    "response_trailers": ep.ProcessingResponse(response_trailers=ep.TrailersResponse()),
}


@dataclass
class _Stream:
    """One Process stream's state."""

    deadline_s: float
    duplex: bool = False
    picked: bool = False
    over: bool = False  # answered with a refusal: the stream ends
    body: bytearray = dataclass_field(default_factory=bytearray)


async def _until_picked(
    requests: AsyncIterator[ep.ProcessingRequest], stream: _Stream, context: Any
) -> AsyncIterator[ep.ProcessingRequest]:
    """The stream's messages; until its pick each must come within the stream's deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + stream.deadline_s
    iterator = aiter(requests)
    while True:
        try:
            if stream.picked:
                request = await anext(iterator)
            else:
                request = await asyncio.wait_for(anext(iterator), max(0.0, deadline - loop.time()))
        except StopAsyncIteration:
            return
        except TimeoutError:
            log.info(kv(event="epp_pick_deadline", peer=context.peer(), seconds=stream.deadline_s))
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"no request within {stream.deadline_s:g} s")
            return
        yield request


class EndpointPicker(ep_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """Envoy's ExternalProcessor service for one pdserve service's routers."""

    def __init__(
        self, model_name: str, candidates: Callable[[], Sequence[Candidate]], limits: PickerLimits | None = None
    ) -> None:
        self.model_name = model_name
        self.candidates = candidates
        self.limits = limits or PickerLimits()
        self.picks = 0
        self.buffered = 0  # request-body bytes held by all streams now
        self.parser = BodyParser(self.limits.parse)

    async def Process(  # noqa: N802  (the protocol's name)
        self, request_iterator: AsyncIterator[ep.ProcessingRequest], context: Any
    ) -> AsyncIterator[ep.ProcessingResponse]:
        stream = _Stream(self.limits.pick_deadline_s)
        try:
            async for request in _until_picked(request_iterator, stream, context):
                for answer in await self._handle(request, stream):
                    yield answer
                if stream.over:
                    return
        finally:
            self.buffered -= len(stream.body)

    async def _handle(self, request: ep.ProcessingRequest, stream: _Stream) -> list[ep.ProcessingResponse]:
        """The answers to one message of a stream."""
        if request.HasField("protocol_config"):
            stream.duplex = request.protocol_config.request_body_mode == FULL_DUPLEX
        phase = request.WhichOneof("request")
        if phase == "request_headers":
            if request.request_headers.end_of_stream:  # no body: nothing to read the model from
                stream.picked = True
                return [self._decide({}, phase)]
            return [] if stream.duplex else [_CONTINUE[phase]]
        if phase == "request_body":
            return await self._body(request.request_body, stream)
        return [_CONTINUE[phase]] if phase in _CONTINUE else []

    async def _body(self, part: ep.HttpBody, stream: _Stream) -> list[ep.ProcessingResponse]:
        if len(stream.body) + len(part.body) > MAX_BODY_BYTES:
            stream.over = True
            return [_error(413, f"request body over {MAX_BODY_BYTES} bytes", "request_too_large")]
        if self.buffered + len(part.body) > self.limits.body_budget_bytes:
            stream.over = True
            log.warning(kv(event="epp_body_budget_full", buffered=self.buffered))
            return [_error(503, "the endpoint picker holds too many request bodies; retry", "picker_busy")]
        stream.body += part.body
        self.buffered += len(part.body)
        if not part.end_of_stream:
            return []
        try:
            answers = await self._answer_body(bytes(stream.body), stream.duplex)
        finally:
            self.buffered -= len(stream.body)
            stream.body.clear()
        stream.picked = True
        return answers

    async def _answer_body(self, raw: bytes, duplex: bool) -> list[ep.ProcessingResponse]:
        """The answers to a whole body: in full duplex the routed headers, then the body back."""
        answer = await self._from_body(raw, "request_headers" if duplex else "request_body")
        if not duplex or answer.HasField("immediate_response"):
            return [answer]
        streamed = ep.StreamedBodyResponse(body=raw, end_of_stream=True)
        back = ep.BodyResponse(response=ep.CommonResponse(body_mutation=ep.BodyMutation(streamed_response=streamed)))
        return [answer, ep.ProcessingResponse(request_body=back)]

    async def _from_body(self, raw: bytes, phase: str = "request_body") -> ep.ProcessingResponse:
        try:
            parsed = await self.parser.parse(raw)
        except InvalidBody as exc:
            return _error(400, str(exc), "invalid_json")
        if isinstance(parsed, Unparsed):  # routed by its first bytes; the router checks the model
            return self._decide_key(raw[:AFFINITY_CHARS].decode(errors="replace"), phase)
        model = parsed.get("model")
        if model is not None and model != self.model_name:
            return _error(
                404,
                f"The model {str(model)[:256]!r} does not exist; this gateway route serves {self.model_name!r}",
                "model_not_found",
            )
        return self._decide(parsed, phase)

    def _decide(self, parsed: dict[str, Any], phase: str) -> ep.ProcessingResponse:
        return self._decide_key(affinity_key(parsed), phase)

    def _decide_key(self, key: str, phase: str) -> ep.ProcessingResponse:
        chosen = pick(self.candidates(), key)
        if chosen is None:
            log.warning(kv(event="epp_no_endpoint", model=self.model_name))
            return _error(503, "no pdserve router is ready for this model", "no_endpoint")
        self.picks += 1
        return _routed(chosen.address, phase)


def add_to(server: Any, picker: EndpointPicker) -> None:
    ep_grpc.add_ExternalProcessorServicer_to_server(picker, server)


@dataclass
class PickerServer:
    """A serving picker: the gRPC server and the per-address front before it."""

    server: Any
    front: Any
    port: int

    async def stop(self, grace_s: float) -> None:
        await self.server.stop(grace_s)
        await self.front.close()


async def serve(
    picker: EndpointPicker, host: str, port: int, tokens: TokenTable, tls: TLSConfig | None = None
) -> PickerServer:
    """The picker on host:port (0: a free one) behind the per-address connection cap of every
    worker port (pdserve_common/grpc_front.py), with `picker.limits`, admitting callers whose
    token `tokens` knows as the gateway's (or the service's); with `tls`, over TLS (a server
    certificate only: gateways present none). OSError if it cannot listen."""
    from pdserve_common.channels import GrpcLimits, listen

    lim = picker.limits
    conn = GrpcLimits(idle_timeout_ms=lim.idle_timeout_ms, max_connections=lim.max_connections)
    options = [("grpc.max_concurrent_streams", lim.streams_per_connection), *conn.options()]
    auth = ServiceAuthInterceptor(tokens, {PROCESS: frozenset({GATEWAY_ROLE})})
    server = grpc.aio.server(maximum_concurrent_rpcs=lim.max_streams, options=options, interceptors=[auth])
    add_to(server, picker)
    tls = TLSConfig(tls.cert_file, tls.key_file) if tls is not None else None
    bound, front = await listen(server, host, port, tls, conn, per_peer=lim.connections_per_peer)
    await server.start()
    return PickerServer(server, front, bound)
