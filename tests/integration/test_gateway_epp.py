"""The endpoint picker in a running deployment (issue #34): `pdserve local --routers 2
--epp-port P` serves Envoy's ext_proc on router-0; a client built from Envoy's own stubs plays
the gateway. The picked endpoint is one of the service's two routers (from the broker's
membership, their registered HTTP endpoints), the one the picker's rule names for that prompt,
and a request sent there is served."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import httpx
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from pdserve_common.auth import bearer_metadata
from pdserve_common.credentials import gateway_token
from pdserve_worker.gateway.endpoint_picker import Candidate, affinity_key, pick
from pdserve_worker.util.free_ports import free_port

pytestmark = pytest.mark.slow


async def ask(address: str, body: dict, token: str) -> ep.ProcessingResponse:
    """One request through the picker, as a gateway presenting `token` (#58 A3) asks."""
    hdrs = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":path", raw_value=b"/v1/completions")])
    requests = [
        ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=hdrs)),
        ep.ProcessingRequest(request_body=ep.HttpBody(body=json.dumps(body).encode(), end_of_stream=True)),
    ]
    async with grpc.aio.insecure_channel(address) as channel:
        stub = ep_grpc.ExternalProcessorStub(channel)
        return [r async for r in stub.Process(iter(requests), metadata=bearer_metadata(token))][-1]


def test_the_gateway_is_sent_to_a_router_that_serves_the_request(tiny_model_dir, tmp_path, local_deployments):
    epp = free_port()
    run = local_deployments(tmp_path, tiny_model_dir, routers=2, epp_port=epp)
    try:
        gateway = gateway_token(run.token)  # what the operator's Secret holds as token-gateway
        assert open(run.manifest["gateway_token_file"]).read() == gateway  # (what a user is given)
        routers = [run.child(name) for name in ("router-0", "router-1")]
        endpoints = sorted(f"127.0.0.1:{r['http'].rsplit(':', 1)[-1]}" for r in routers)
        model = httpx.get(f"{run.url}/v1/models").json()["data"][0]["id"]
        deadline = time.monotonic() + 30
        seen: set[str] = set()
        while seen != set(endpoints):  # both routers registered: each prompt picks one of them
            assert time.monotonic() < deadline, f"the picker saw {seen}, the deployment has {endpoints}"
            body = {"model": model, "prompt": f"Paris is the capital of {len(seen)} {time.monotonic()}"}
            reply = asyncio.run(ask(f"127.0.0.1:{epp}", body, gateway))
            [option] = reply.request_body.response.header_mutation.set_headers
            seen.add(option.header.raw_value.decode())
        body = {"model": model, "prompt": "Paris is the capital of", "max_tokens": 4, "temperature": 0}
        reply = asyncio.run(ask(f"127.0.0.1:{epp}", body, gateway))
        [option] = reply.request_body.response.header_mutation.set_headers
        picked = option.header.raw_value.decode()
        assert picked == pick([Candidate(e) for e in endpoints], affinity_key(body)).address  # (idle: no load)
        served = httpx.post(f"http://{picked}/v1/completions", json=body, timeout=60)
        assert served.status_code == 200 and served.json()["choices"][0]["text"]
        unknown = asyncio.run(ask(f"127.0.0.1:{epp}", {**body, "model": "gpt-9"}, gateway))
        assert unknown.immediate_response.status.code == 404
    finally:
        run.stop_cleanly()
