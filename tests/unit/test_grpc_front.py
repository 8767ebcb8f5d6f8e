"""The per-address cap in front of every gRPC port (pdserve_common/grpc_front.py): calls go
through it unchanged (plaintext and TLS alike, as far as gRPC is concerned), one source address
holds at most its share, and a closed connection gives its place back."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest

from pdserve.v1 import broker_pb2, broker_pb2_grpc
from pdserve_common.auth import TokenTable
from pdserve_common.channels import GrpcLimits, aio_channel, aio_server, listen
from pdserve_common.grpc_front import PeerCappedFront, per_peer_from_env

TOKEN = "front-test-token"


class Members(broker_pb2_grpc.BrokerServicer):
    async def ListMembers(self, request, context):  # noqa: N802 (gRPC's name)
        return broker_pb2.ListMembersReply()


async def serving(per_peer: int, total: int):
    server = aio_server(TokenTable({"ns/svc": TOKEN}), limits=GrpcLimits(max_connections=total))
    broker_pb2_grpc.add_BrokerServicer_to_server(Members(), server)
    import os

    os.environ["PDSERVE_GRPC_MAX_CONNECTIONS_PER_PEER"] = str(per_peer)
    try:
        port, front = await listen(server, "127.0.0.1", 0, None, GrpcLimits(max_connections=total))
    finally:
        del os.environ["PDSERVE_GRPC_MAX_CONNECTIONS_PER_PEER"]
    await server.start()
    return server, front, port


async def call(port: int, token: str = TOKEN) -> grpc.StatusCode:
    channel = aio_channel(f"127.0.0.1:{port}", token)
    try:
        await broker_pb2_grpc.BrokerStub(channel).ListMembers(
            broker_pb2.ListMembersRequest(service_key="ns/svc"), timeout=5
        )
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    finally:
        await channel.close()


def idle_from(source: str, port: int, count: int) -> list[socket.socket]:
    socks = []
    for _ in range(count):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind((source, 0))
        s.connect(("127.0.0.1", port))
        socks.append(s)
    return socks


@pytest.mark.asyncio
async def test_calls_pass_through_and_the_token_is_still_checked():
    server, front, port = await serving(per_peer=8, total=32)
    try:
        assert await call(port) == grpc.StatusCode.OK
        assert await call(port, "a-wrong-token") == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await server.stop(None)
        await front.close()


@pytest.mark.asyncio
async def test_one_address_holds_its_share_and_the_others_are_served():
    server, front, port = await serving(per_peer=4, total=32)
    flood = idle_from("127.0.0.2", port, 20)
    try:
        await asyncio.sleep(0.3)
        assert front.counts.open.get("127.0.0.2") == 4
        assert front.counts.refused_peer == 16
        assert await call(port) == grpc.StatusCode.OK  # from 127.0.0.1
    finally:
        for s in flood:
            s.close()
    await asyncio.sleep(0.3)
    assert "127.0.0.2" not in front.counts.open  # closed connections gave their places back
    more = idle_from("127.0.0.2", port, 2)
    await asyncio.sleep(0.2)
    assert front.counts.open.get("127.0.0.2") == 2
    for s in more:
        s.close()
    await server.stop(None)
    await front.close()


@pytest.mark.asyncio
async def test_the_total_cap_holds_across_addresses():
    server, front, port = await serving(per_peer=100, total=3)
    socks = [*idle_from("127.0.0.2", port, 2), *idle_from("127.0.0.3", port, 3)]
    try:
        await asyncio.sleep(0.3)
        assert front.counts.total == 3 and front.counts.refused_total == 2
    finally:
        for s in socks:
            s.close()
        await server.stop(None)
        await front.close()


def test_the_per_peer_setting_is_checked():
    assert per_peer_from_env(1024, {}) == 256
    assert per_peer_from_env(1024, {"PDSERVE_GRPC_MAX_CONNECTIONS_PER_PEER": "8"}) == 8
    for bad in ("0", "-1", "many"):
        with pytest.raises(ValueError, match="PDSERVE_GRPC_MAX_CONNECTIONS_PER_PEER must be a positive integer"):
            per_peer_from_env(1024, {"PDSERVE_GRPC_MAX_CONNECTIONS_PER_PEER": bad})
    with pytest.raises(ValueError, match="caps must be positive"):
        PeerCappedFront("x", 0, 5)


@pytest.mark.asyncio
async def test_the_inner_server_is_a_socket_file_only_its_user_can_reach():
    """#58 A9: the inner server was on an abstract unix socket, which has no permissions: any
    process of the network namespace connected to it past both caps. Now a socket file in a
    0700 folder, not listed among the abstract sockets, and removed with the front."""
    import os
    import stat
    from pathlib import Path

    server, front, port = await serving(per_peer=4, total=8)
    try:
        folder = Path(front.inner).parent
        assert stat.S_ISSOCK(os.stat(front.inner).st_mode)
        assert folder.stat().st_mode & 0o777 == 0o700 and folder.stat().st_uid == os.getuid()
        abstract = [line.split()[-1] for line in Path("/proc/net/unix").read_text().splitlines()[1:] if "@" in line]
        assert not any(f"pdserve-grpc-{os.getpid()}-" in name for name in abstract), abstract  # (the old naming)
        assert await call(port) == grpc.StatusCode.OK  # still served through the front
    finally:
        await server.stop(None)
        await front.close()
    assert not folder.exists()
