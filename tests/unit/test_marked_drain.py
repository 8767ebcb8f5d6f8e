"""A decode the operator marks draining (scale-down, autoscale/drain.py) drains itself: the broker's
KeepAlive reply carries the mark, the worker process's membership (worker_main._Membership)
starts the same drain /drain does, once, and reports its load (migration counts) at once.

Real broker server and client over gRPC on 127.0.0.1; the role is a recorder (the drain's
migrate mode itself is tested in tests/integration/test_migration_serving.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from pdserve_common.kv_layout import KVLayout
from pdserve_common.membership import Load, MemberInfo, MemoryRegion, Role
from pdserve_operator.broker.server import BrokerServer
from pdserve_worker.process.pod_http import WorkerState
from pdserve_worker.process.worker_main import _Membership
from pdserve_worker.rpc.backoff import Backoff
from pdserve_worker.rpc.broker_client import BrokerClient
from pdserve_worker.serving.settings import WorkerSettings

SVC, TOKEN, TTL = "ns/svc", "tok", 0.3


@pytest.fixture
def broker() -> Iterator[BrokerServer]:
    server = BrokerServer({SVC: TOKEN}, ttl_s=TTL, resync_grace_s=TTL / 2)
    server.start("127.0.0.1", 0)
    yield server
    server.stop(0)


class RecordingRole:
    """A decode role that counts its drains; draining "migrates" its requests."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.drains = 0
        self.running = 2
        self.migrated = 0

    def member_info(self) -> MemberInfo:
        layout = KVLayout(num_slots=4, num_layers=2, max_len=16, kv_heads=1, head_dim=8, dtype="float32")
        return MemberInfo(
            worker_id=self.worker_id,
            role=Role.DECODE,
            grpc_endpoint="127.0.0.1:7000",
            engine_id="127.0.0.1:7100",
            regions=(MemoryRegion(0x10000, layout.total_bytes),),
            kv_layout=layout,
            revision="r1",
            slots_total=4,
            slots_free=4,
        )

    def load(self) -> Load:
        return Load(
            slots_used=self.running,
            slots_free=4 - self.running,
            active_requests=self.running,
            migrated=self.migrated,
            migration_fallbacks=0,
        )

    async def drain(self, timeout_s: float) -> bool:
        self.drains += 1
        await asyncio.sleep(0.01)
        self.migrated, self.running = self.migrated + self.running, 0
        return True

    def busy(self) -> int:
        return self.running


def membership(broker: BrokerServer, role: str = "decode") -> _Membership:
    settings = WorkerSettings(
        role=role,
        service=SVC,
        broker_address=f"127.0.0.1:{broker.port}",
        broker_token=TOKEN,
        worker_id="svc-decode-1",
        advertise_host="127.0.0.1",
    )
    m = _Membership(settings, WorkerState(settings.role, settings.member_id))
    m.broker = BrokerClient(settings.broker_address, SVC, TOKEN, backoff=Backoff(base_s=0.05, cap_s=0.2))
    return m


async def eventually(condition, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.02)


@pytest.mark.asyncio
async def test_a_decode_marked_draining_drains_once_and_reports_its_counts(broker: BrokerServer) -> None:
    m = membership(broker)
    role = RecordingRole("svc-decode-1")
    m.role = role
    await m.join(role)
    try:
        assert m.state.phase == "ready"
        await asyncio.sleep(TTL)  # a few keepalives: unmarked, nothing happens
        assert role.drains == 0
        # What the operator's autoscaler does (by worker id, holding the service's token).
        assert broker.registry.set_draining(SVC, worker_id="svc-decode-1", draining=True)
        await eventually(lambda: role.drains == 1 and m.marked_drain is not None and m.marked_drain.done())
        assert m.state.phase == "draining"
        assert m.broker.draining  # the mark is its own now: a re-registration keeps it
        # Still registered (the operator reads the counts), idle, with the counts reported.
        member = next(x for x in broker.registry.members(SVC) if x.worker_id == "svc-decode-1")
        assert member.draining and member.load.migrated == 2 and member.load.active_requests == 0
        await asyncio.sleep(TTL)  # later keepalives (still marked) start no second drain
        assert role.drains == 1
        # Unmarked (a scale-down cancelled after the drain): a drained decode takes nothing new,
        # so it marks itself again rather than have routers send it requests it refuses.
        assert broker.registry.set_draining(SVC, worker_id="svc-decode-1", draining=False)
        await eventually(lambda: all(x.draining for x in broker.registry.members(SVC)))
        assert role.drains == 1
        await m.leave()  # the pod's stop: nothing left to drain, it leaves the broker
        assert role.drains == 1
        assert not broker.registry.members(SVC)
    finally:
        await m.broker.close()


@pytest.mark.asyncio
async def test_an_unmarked_decode_and_a_marked_prefill_do_not_drain(broker: BrokerServer) -> None:
    m = membership(broker, role="prefill")
    role = RecordingRole("svc-decode-1")  # registers as a decode member; the process is a prefill
    m.role = role
    await m.join(role)
    try:
        assert broker.registry.set_draining(SVC, worker_id="svc-decode-1", draining=True)
        await asyncio.sleep(TTL * 1.5)
        assert role.drains == 0 and m.state.phase == "ready" and m.marked_drain is None
        assert not m.broker.draining  # nobody acts on it: the mark stays the operator's to lift
        assert broker.registry.set_draining(SVC, worker_id="svc-decode-1", draining=False)
        await asyncio.sleep(TTL)
        assert not any(x.draining for x in broker.registry.members(SVC))
    finally:
        await m.broker.close()


@pytest.mark.asyncio
async def test_over_the_wire_a_worker_drains_only_itself(broker: BrokerServer) -> None:
    """Marked draining, a decode now really drains: a pod with the service's token (a router,
    say) must not be able to empty the other decodes. SetDraining by worker_id is refused over
    gRPC (the operator marks members in its own process); a worker's own lease still works."""
    import grpc

    from pdserve.v1 import broker_pb2, broker_pb2_grpc

    m = membership(broker)
    role = RecordingRole("svc-decode-1")
    m.role = role
    await m.join(role)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{broker.port}") as channel:
            stub = broker_pb2_grpc.BrokerStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.SetDraining(
                    broker_pb2.SetDrainingRequest(service_key=SVC, worker_id="svc-decode-1", draining=True),
                    metadata=(("authorization", f"Bearer {TOKEN}"),),
                    timeout=5,
                )
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "drains only itself" in (refused.value.details() or "")
        await asyncio.sleep(TTL)
        assert role.drains == 0 and not broker.registry.draining_of(SVC, m.broker.lease_id)
        assert await m.broker.set_draining(True)  # its own lease: allowed
        assert broker.registry.draining_of(SVC, m.broker.lease_id)
    finally:
        await m.broker.close()
