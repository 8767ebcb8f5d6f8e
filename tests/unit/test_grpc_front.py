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


@pytest.mark.asyncio
async def test_many_addresses_cannot_fill_the_front_with_the_default_share():
    """#58 A9: the default share was a quarter, so 4 addresses filled a worker's port. Now a
    sixty-fourth: 8 addresses, each trying 40 connections (what a quarter let in), hold 16
    each, 128 of 1,024, and another address is still served."""
    total = 1024
    share = per_peer_from_env(total, {})
    assert share == 16 and total // share == 64  # 64 addresses to fill it, not 4
    server = aio_server(TokenTable({"ns/svc": TOKEN}), limits=GrpcLimits(max_connections=total))
    broker_pb2_grpc.add_BrokerServicer_to_server(Members(), server)
    port, front = await listen(server, "127.0.0.1", 0, None, GrpcLimits(max_connections=total))
    await server.start()
    sources = [f"127.0.0.{i}" for i in range(2, 10)]
    flood = [s for source in sources for s in idle_from(source, port, 40)]
    try:
        await asyncio.sleep(0.5)
        assert {source: front.counts.open.get(source) for source in sources} == dict.fromkeys(sources, share)
        assert front.counts.refused_peer == len(sources) * (40 - share) and front.counts.refused_total == 0
        assert await call(port) == grpc.StatusCode.OK  # from 127.0.0.1
    finally:
        for s in flood:
            s.close()
        await server.stop(None)
        await front.close()


def test_the_per_peer_setting_is_checked():
    assert per_peer_from_env(1024, {}) == 16  # a sixty-fourth
    assert per_peer_from_env(8192, {}) == 128  # the broker's
    assert per_peer_from_env(48, {}) == 8  # at least 8: a pod's one or two channels, several times over
    assert per_peer_from_env(4, {}) == 4  # and never more than the total
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


def test_pdserve_local_sizes_the_share_for_its_one_address(monkeypatch):
    """Every process of `pdserve local` connects from 127.0.0.1, so the run sets the share from
    its process count (cli/local_env.py) rather than a pod's sixty-fourth; a user's setting wins."""
    import itertools

    from pdserve_worker.cli.local_env import RunFacts, broker_env, grpc_per_peer, worker_env
    from pdserve_worker.cli.local_plan import LocalPlan

    monkeypatch.delenv("PDSERVE_GRPC_MAX_CONNECTIONS_PER_PEER", raising=False)
    assert grpc_per_peer(LocalPlan(prefill=1, decode=1)) == 16
    big = LocalPlan(prefill=4, decode=4, routers=2)
    assert grpc_per_peer(big) == 4 * (2 + 8)
    run = RunFacts(big, "float32", 256, "/models/m", "m", "127.0.0.1:1", "tok", None)
    ports = itertools.count(20000)
    assert (
        worker_env(run, "decode", "decode-0", 8000, lambda: next(ports))["PDSERVE_GRPC_MAX_CONNECTIONS_PER_PEER"]
        == "40"
    )
    assert broker_env(run)["PDSERVE_GRPC_MAX_CONNECTIONS_PER_PEER"] == "40"
    monkeypatch.setenv("PDSERVE_GRPC_MAX_CONNECTIONS_PER_PEER", "7")
    assert broker_env(run)["PDSERVE_GRPC_MAX_CONNECTIONS_PER_PEER"] == "7"
