"""A Prefill call that found nobody listening never left the router (rpc/trailers.py,
`never_sent`): its decode slot can be given back free instead of quarantined for a lease. A
call that reached a server answering UNAVAILABLE is not that case."""

from __future__ import annotations

import asyncio
import socket

import grpc

from pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve_worker.rpc.trailers import never_sent


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: nothing listens there


class Unavailable(worker_pb2_grpc.PrefillServicer):
    async def Prefill(self, request, context):
        await context.abort(grpc.StatusCode.UNAVAILABLE, "prefill p0 is draining")


async def call(port: int) -> grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            await worker_pb2_grpc.PrefillStub(channel).Prefill(worker_pb2.PrefillRequest(request_id="r"), timeout=5)
        except grpc.aio.AioRpcError as exc:
            return exc
    raise AssertionError("the call did not fail")


def test_nobody_listening_is_never_sent_and_a_server_refusal_is_not():
    async def run() -> tuple[grpc.aio.AioRpcError, grpc.aio.AioRpcError]:
        refused = await call(closed_port())
        server = grpc.aio.server()
        worker_pb2_grpc.add_PrefillServicer_to_server(Unavailable(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            answered = await call(port)
        finally:
            await server.stop(0)
        return refused, answered

    refused, answered = asyncio.run(run())
    assert refused.code() == grpc.StatusCode.UNAVAILABLE and never_sent(refused), refused.details()
    assert answered.code() == grpc.StatusCode.UNAVAILABLE and not never_sent(answered)
    assert not never_sent(ValueError("not a gRPC error"))
