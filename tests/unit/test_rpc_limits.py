"""Explicit gRPC message sizes on both ends (issue 13, D6: gRPC's implicit 4 MiB receive limit
turned large stop strings into a 500 at the decode), and the admin endpoint's token."""

from __future__ import annotations

import grpc
import httpx
import pytest

from pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve_common.auth import TokenTable
from pdserve_common.channels import WORKER_MAX_MESSAGE, aio_channel, aio_server, bind

SVC, TOKEN = "ns/svc", "tok"


class CountingPrefill(worker_pb2_grpc.PrefillServicer):
    def __init__(self) -> None:
        self.calls = 0

    async def Prefill(self, request, context):
        self.calls += 1
        return worker_pb2.PrefillReply(num_tokens=len(request.prompt_token_ids))


@pytest.mark.asyncio
async def test_a_message_past_the_servers_limit_never_reaches_the_handler(port):
    servicer = CountingPrefill()
    server = aio_server(TokenTable({SVC: TOKEN}), max_message=1 << 20)
    worker_pb2_grpc.add_PrefillServicer_to_server(servicer, server)
    bind(server, "127.0.0.1", port)
    await server.start()
    try:
        async with aio_channel(f"127.0.0.1:{port}", TOKEN) as channel:
            stub = worker_pb2_grpc.PrefillStub(channel)
            reply = await stub.Prefill(worker_pb2.PrefillRequest(prompt_token_ids=[7] * 100_000))
            assert reply.num_tokens == 100_000
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Prefill(worker_pb2.PrefillRequest(prompt_token_ids=[2**20] * 600_000))  # ~1.8 MB
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert servicer.calls == 1
    finally:
        await server.stop(0)


@pytest.mark.asyncio
async def test_the_worker_limit_carries_the_largest_prompt_a_spec_allows(port):
    """spec.model.maxLength is at most 1,048,576 tokens; with the largest vocabularies' ids
    (5 bytes of varint at most) and 16 KiB of stop strings, a request still fits."""
    servicer = CountingPrefill()
    server = aio_server(TokenTable({SVC: TOKEN}))
    worker_pb2_grpc.add_PrefillServicer_to_server(servicer, server)
    bind(server, "127.0.0.1", port)
    await server.start()
    try:
        request = worker_pb2.PrefillRequest(prompt_token_ids=[2**31 - 1] * 1_048_576)
        request.sampling.stop.extend(["s" * 1024] * 16)
        assert request.ByteSize() < WORKER_MAX_MESSAGE
        async with aio_channel(f"127.0.0.1:{port}", TOKEN) as channel:
            reply = await worker_pb2_grpc.PrefillStub(channel).Prefill(request)
        assert reply.num_tokens == 1_048_576
    finally:
        await server.stop(0)


def test_the_admin_drain_wants_the_service_token():
    from starlette.testclient import TestClient

    from pdserve_worker.process.pod_http import admin_app

    drained = []

    async def drain():
        drained.append(True)
        return {"drained": True}

    client = TestClient(admin_app(TokenTable({SVC: TOKEN}), drain))
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": TOKEN}):
        assert client.get("/drain", headers=headers).status_code == 401
    assert drained == []
    assert client.get("/drain", headers={"Authorization": f"Bearer {TOKEN}"}).json() == {"drained": True}
    assert drained == [True]
    assert httpx.codes.NOT_FOUND == client.get("/healthz").status_code  # admin only: no pod endpoints here
