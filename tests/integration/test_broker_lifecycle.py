"""The broker and its client over real gRPC on 127.0.0.1: leases, watch, draining, tokens,
a broker restart, and TLS."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from pdserve.v1 import broker_pb2, broker_pb2_grpc
from pdserve_common.auth import TLSConfig
from pdserve_common.channels import aio_channel
from pdserve_common.kv_layout import KVLayout
from pdserve_common.membership import EventType, Load, MemberEvent, MemberInfo, MemoryRegion, Role
from pdserve_operator.broker.server import BrokerServer
from pdserve_worker.rpc.backoff import Backoff
from pdserve_worker.rpc.broker_client import BrokerClient, BrokerError
from pdserve_worker.rpc.broker_watch import MembershipView

SVC, OTHER = "ns/a", "ns/b"
TOKENS = {SVC: "tok-a", OTHER: "tok-b"}
TTL = 1.0
FAST = Backoff(base_s=0.05, cap_s=0.5)


def decode(worker_id: str) -> MemberInfo:
    layout = KVLayout(num_slots=4, num_layers=2, max_len=16, kv_heads=1, head_dim=8, dtype="float32")
    return MemberInfo(
        worker_id=worker_id,
        role=Role.DECODE,
        grpc_endpoint="127.0.0.1:7000",
        engine_id="127.0.0.1:7100",
        regions=(MemoryRegion(0x10000, layout.total_bytes),),
        kv_layout=layout,
        revision="r1",
        slots_total=4,
        slots_free=4,
    )


def start_broker(port: int = 0, tls: TLSConfig | None = None) -> BrokerServer:
    broker = BrokerServer(TOKENS, ttl_s=TTL, resync_grace_s=TTL / 2, tls=tls)
    broker.start("127.0.0.1", port)
    return broker


@pytest.fixture
def broker() -> Iterator[BrokerServer]:
    server = start_broker()
    yield server
    server.stop(0)


def client(
    broker: BrokerServer, service: str = SVC, token: str = "tok-a", tls: TLSConfig | None = None
) -> BrokerClient:
    return BrokerClient(f"127.0.0.1:{broker.port}", service, token, tls, backoff=FAST)


async def eventually(condition, timeout_s: float) -> None:
    """Poll a condition that no event announces (a client's own counters)."""
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.02)


async def connected_view(watcher: BrokerClient, events: list[MemberEvent] | None = None) -> MembershipView:
    view = await watcher.watch([Role.DECODE], listener=events.append if events is not None else None)
    await view.wait_for(lambda v: v.connected, 5)
    return view


@pytest.mark.asyncio
async def test_register_keepalive_drain_deregister(broker: BrokerServer) -> None:
    events: list[MemberEvent] = []
    async with client(broker) as watcher, client(broker) as worker:
        view = await connected_view(watcher, events)
        await worker.register(decode("d0"), load=lambda: Load(slots_used=1, slots_free=3, active_requests=1))
        await view.wait_for(lambda v: "d0" in v.members, 5)

        await asyncio.sleep(3 * TTL)  # three lease lifetimes: only the keepalive can keep it
        assert [m.worker_id for m in broker.members(SVC)] == ["d0"]
        assert view.get("d0").load == Load(slots_used=1, slots_free=3, active_requests=1)
        assert broker.registered_counts(SVC) == {Role.PREFILL: 0, Role.DECODE: 1, Role.ROUTER: 0}

        assert await worker.set_draining()
        await view.wait_for(lambda v: v.get("d0").draining, 5)
        assert view.by_role(Role.DECODE) == [] and len(view.by_role(Role.DECODE, include_draining=True)) == 1

        assert await worker.deregister()
        await view.wait_for(lambda v: not v.members, 5)
    assert [(e.type, e.member.worker_id) for e in events] == [
        (EventType.ADDED, "d0"),
        (EventType.UPDATED, "d0"),  # the first keepalive's load; the same load again is no event
        (EventType.DRAINING, "d0"),
        (EventType.REMOVED, "d0"),
    ]


@pytest.mark.asyncio
async def test_update_replaces_the_info_and_the_lease(broker: BrokerServer) -> None:
    async with client(broker) as watcher, client(broker) as worker:
        view = await connected_view(watcher)
        await worker.register(decode("d0"))
        first_lease = worker.lease_id
        await worker.update(replace(decode("d0"), slots_free=1, labels={"zone": "z1"}))
        await view.wait_for(lambda v: v.get("d0") is not None and v.get("d0").info.slots_free == 1, 5)
        assert view.get("d0").info.labels == {"zone": "z1"}
        assert worker.lease_id != first_lease
        assert [m.info.slots_free for m in broker.members(SVC)] == [1]
        with pytest.raises(ValueError, match="keeps the worker_id"):
            await worker.update(decode("d1"))


@pytest.mark.asyncio
async def test_a_lease_that_is_not_renewed_expires(broker: BrokerServer) -> None:
    async with client(broker) as watcher:
        view = await connected_view(watcher)
        worker = client(broker)
        await worker.register(decode("d0"))
        await view.wait_for(lambda v: "d0" in v.members, 5)
        await worker.close()  # the worker dies: no keepalive, no deregister
        stopped = time.monotonic()
        await view.wait_for(lambda v: "d0" not in v.members, 5 * TTL)
        elapsed = time.monotonic() - stopped
    assert TTL / 2 <= elapsed <= TTL + 1.5, f"removed {elapsed:.2f}s after the last keepalive could run"
    assert broker.members(SVC) == []


@pytest.mark.asyncio
async def test_tokens_keep_services_apart(broker: BrokerServer) -> None:
    async with client(broker) as worker:
        await worker.register(decode("d0"))
    address = f"127.0.0.1:{broker.port}"

    async def watch_first(channel: grpc.aio.Channel, service: str) -> grpc.StatusCode:
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            async for _ in broker_pb2_grpc.BrokerStub(channel).Watch(broker_pb2.WatchRequest(service_key=service)):
                pass
        return failed.value.code()

    async with aio_channel(address, "tok-b") as other_service:
        assert await watch_first(other_service, SVC) == grpc.StatusCode.PERMISSION_DENIED
        listed = await broker_pb2_grpc.BrokerStub(other_service).ListMembers(
            broker_pb2.ListMembersRequest(service_key=OTHER)
        )
        assert list(listed.members) == [], "service b must not see service a's members"
    async with grpc.aio.insecure_channel(address) as anonymous:
        assert await watch_first(anonymous, SVC) == grpc.StatusCode.UNAUTHENTICATED
    async with aio_channel(address, "tok-unknown") as forged:
        assert await watch_first(forged, SVC) == grpc.StatusCode.UNAUTHENTICATED

    intruder = BrokerClient(address, SVC, "tok-b", backoff=FAST)
    with pytest.raises(BrokerError) as refused:
        await intruder.register(decode("evil"), timeout_s=5)
    await intruder.close()
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert [m.worker_id for m in broker.members(SVC)] == ["d0"]


@pytest.mark.asyncio
async def test_invalid_member_is_refused_with_the_reason(broker: BrokerServer) -> None:
    bad = broker_pb2.RegisterRequest(
        service_key=SVC, member=broker_pb2.MemberInfo(worker_id="d9", role=broker_pb2.ROLE_DECODE)
    )
    async with aio_channel(f"127.0.0.1:{broker.port}", "tok-a") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await broker_pb2_grpc.BrokerStub(channel).Register(bad)
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "grpc_endpoint" in failed.value.details()


@pytest.mark.asyncio
async def test_broker_restart_workers_reregister_and_views_recover(port: int) -> None:
    first = start_broker(port)
    second: BrokerServer | None = None
    try:
        async with client(first) as watcher, client(first) as d0, client(first) as d1:
            view = await connected_view(watcher)
            await d0.register(decode("d0"))
            await d1.register(decode("d1"))
            await view.wait_for(lambda v: set(v.members) == {"d0", "d1"}, 5)

            first.stop(0)
            await view.wait_for(lambda v: not v.connected, 5)
            assert not await d0.set_draining(), "nobody can hear it now, but d0 must remember it"
            await d1.close()  # d1 dies while the broker is away: it will not come back
            await asyncio.sleep(2 * TTL)  # longer than a lease: the view must not age members out by itself
            assert set(view.members) == {"d0", "d1"}, "the last-known membership must stay while the broker is down"

            second = start_broker(port)
            await view.wait_for(
                lambda v: v.connected and v.broker_id == second.broker_id and set(v.members) == {"d0"}, 10
            )
            assert view.get("d0").draining, "re-registration must carry the draining state"
            # The watcher can see the new registration before d0 has read the broker's reply.
            await eventually(lambda: d0.registrations == 2, 5)
            assert d0.broker_id == second.broker_id
            assert [m.worker_id for m in second.members(SVC)] == ["d0"]
    finally:
        first.stop(0)
        if second is not None:
            second.stop(0)


def write_self_signed(folder: Path) -> tuple[Path, Path]:
    """A CA-capable self-signed certificate for 127.0.0.1/localhost, usable as server and client cert."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pdserve-test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = folder / "tls.crt", folder / "tls.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_file, key_file


@pytest.mark.asyncio
async def test_tls_round_trip_and_plaintext_refused(tmp_path: Path) -> None:
    cert, key = write_self_signed(tmp_path)
    broker = start_broker(tls=TLSConfig(cert_file=cert, key_file=key))
    try:
        async with client(broker, tls=TLSConfig(ca_file=cert)) as secure:
            view = await connected_view(secure)
            await secure.register(decode("d0"))
            await view.wait_for(lambda v: "d0" in v.members, 5)
            assert [m.worker_id for m in await secure.list_members()] == ["d0"]
        async with client(broker) as plaintext:
            with pytest.raises(BrokerError) as refused:
                await plaintext.list_members()
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        broker.stop(0)


@pytest.mark.asyncio
async def test_mutual_tls_needs_a_client_certificate(tmp_path: Path) -> None:
    cert, key = write_self_signed(tmp_path)
    broker = start_broker(tls=TLSConfig(cert_file=cert, key_file=key, ca_file=cert))
    try:
        async with client(broker, tls=TLSConfig(cert_file=cert, key_file=key, ca_file=cert)) as with_cert:
            assert await with_cert.list_members() == []
        async with client(broker, tls=TLSConfig(ca_file=cert)) as without_cert:
            with pytest.raises(BrokerError):
                await without_cert.list_members()
    finally:
        broker.stop(0)
