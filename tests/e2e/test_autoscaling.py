"""Autoscaling end to end: the real operator with its real gRPC broker, on the API emulator.

Fake workers register with the broker over gRPC exactly as pods do (`BrokerClient`): decodes
named as the StatefulSet's pods, a prefill, and a router whose keepalives carry cumulative
request counters and latency histograms (what `router_load` reports) at a rate the test sets.
No pods run (the emulator has no controllers), so every count here is what the operator
wrote to the workloads. Windows are seconds long to keep the module fast.

- load steps up → both roles scale up within the window, within min/max and the P:D band;
- load oscillates faster than the down window → at most one change per role, never down;
- load falls → after the down window decode goes down through a drain: the groups that go are
  marked draining in the broker and the StatefulSet is lowered only once their running
  requests reached 0 (no request lost);
- `kubectl scale` down with no autoscaler → the same drain first: the victim acts on its mark,
  the StatefulSet goes down once it is idle, a DecodeDrained Event and status.lastDrain carry
  its migration counts (issue #17);
- a role an HPA drives (driver hpa, and driver external with a second field manager writing
  the replicas) is never overwritten by the operator.
"""

from __future__ import annotations

import asyncio
import base64
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from conftest import Cluster, OperatorHandle, wait_for
from kube_emulator.managed_fields import owners
from pdserve_common.kv_layout import KVLayout
from pdserve_common.membership import Histogram, Load, MemberInfo, MemoryRegion, Role, RouterLoad
from pdserve_operator import spec as s
from pdserve_operator.broker.server import BrokerServer
from pdserve_operator.broker.view import BrokerServerView
from pdserve_operator.kube import KINDS
from pdserve_worker.rpc.broker_client import BrokerClient

NAME = "scaled"
TTFT_BOUNDS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


def autoscaled_doc(**autoscaling: Any) -> dict[str, Any]:
    spec = {
        "model": {"maxLength": 1024},
        "autoscaling": {
            "prefill": {"enabled": True, "minReplicas": 1, "maxReplicas": 4},
            "decode": {"enabled": True, "minReplicas": 1, "maxReplicas": 4},
            "slo": {"ttftMs": 3000, "tpotMs": 150},
            "ratio": {"minPrefillPerDecode": 0.5, "maxPrefillPerDecode": 2},
            "scaleUpWindowSeconds": 2,
            "scaleDownWindowSeconds": 4,
            "intervalSeconds": 1,
            "expectedPromptTokens": 256,
            "expectedOutputTokens": 64,
            **autoscaling,
        },
    }
    return {"apiVersion": s.API_VERSION, "kind": s.KIND, "metadata": {"name": NAME}, "spec": spec}


@dataclass
class Traffic:
    """What the fake router reports: requests arrive at `rate`/s, each 256 prompt + 64 output tokens."""

    rate: float = 0.0
    requests: float = 0.0
    last: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def set_rate(self, rate: float) -> None:
        with self.lock:
            self._advance()
            self.rate = rate

    def _advance(self) -> None:
        now = time.monotonic()
        self.requests += self.rate * (now - self.last)
        self.last = now

    def load(self) -> Load:
        with self.lock:
            self._advance()
            n = int(self.requests)
        fast = Histogram(TTFT_BOUNDS, tuple(n for _ in TTFT_BOUNDS), n)  # every request within 50 ms
        return Load(
            router=RouterLoad(
                requests_total=n, prompt_tokens_total=256 * n, output_tokens_total=64 * n, ttft=fast, tpot=fast
            )
        )


class FakeWorkers:
    """Workers that only register and report load, on an event loop of their own."""

    def __init__(self, address: str, service: str, token: str) -> None:
        self.address, self.service, self.token = address, service, token
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.clients: dict[str, BrokerClient] = {}
        self.decode_busy: dict[str, int] = {}
        self.traffic = Traffic()

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(15)

    def add_decode(self, worker_id: str) -> None:
        layout = KVLayout(num_slots=8, num_layers=2, max_len=16, kv_heads=1, head_dim=8, dtype="float32")
        info = MemberInfo(
            worker_id=worker_id,
            role=Role.DECODE,
            grpc_endpoint="127.0.0.1:7000",
            engine_id="127.0.0.1:7100",
            regions=(MemoryRegion(0x10000, layout.total_bytes),),
            kv_layout=layout,
            revision="r1",
            slots_total=8,
            slots_free=8,
        )
        self.decode_busy[worker_id] = 0

        def load() -> Load:
            busy = self.decode_busy[worker_id]
            return Load(slots_used=busy, slots_free=8 - busy, active_requests=busy)

        self._register(info, load)

    def add_prefill(self, worker_id: str) -> None:
        self._register(
            MemberInfo(worker_id=worker_id, role=Role.PREFILL, grpc_endpoint="127.0.0.1:7001", revision="r1"),
            lambda: Load(),
        )

    def add_router(self, worker_id: str) -> None:
        self._register(MemberInfo(worker_id=worker_id, role=Role.ROUTER, revision="r1"), self.traffic.load)

    def _register(self, info: MemberInfo, load: Any) -> None:
        async def go() -> BrokerClient:
            client = BrokerClient(self.address, self.service, self.token)
            await client.register(info, load=load, timeout_s=10)
            return client

        self.clients[info.worker_id] = self._run(go())

    def close(self) -> None:
        async def stop() -> None:
            for client in self.clients.values():
                await client.close()

        self._run(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def broker() -> Iterator[BrokerServer]:
    server = BrokerServer(ttl_s=1.5, resync_grace_s=0.1)  # keepalives every 0.5 s
    server.start("127.0.0.1", 0)
    yield server
    server.stop(0)


@pytest.fixture
def scaling_operator(cluster: Cluster, namespace: str, broker: BrokerServer) -> Iterator[OperatorHandle]:
    handle = OperatorHandle(cluster, namespace, broker=BrokerServerView(broker))  # type: ignore[arg-type]
    handle.start()
    yield handle
    handle.stop()


def create(cluster: Cluster, namespace: str, doc: dict[str, Any]) -> None:
    cluster.kube.create({**doc, "metadata": {**doc["metadata"], "namespace": namespace}})


def workers_for(cluster: Cluster, namespace: str, broker: BrokerServer) -> FakeWorkers:
    secret = wait_for(lambda: cluster.get("Secret", namespace, f"{NAME}-broker-token"), what="the broker token")
    token = base64.b64decode(secret["data"]["token"]).decode()
    return FakeWorkers(f"127.0.0.1:{broker.port}", f"{namespace}/{NAME}", token)


def replicas(cluster: Cluster, namespace: str) -> tuple[int, int]:
    dep = cluster.get("Deployment", namespace, f"{NAME}-prefill") or {}
    sts = cluster.get("StatefulSet", namespace, f"{NAME}-decode") or {}
    return int(dep.get("spec", {}).get("replicas", -1)), int(sts.get("spec", {}).get("replicas", -1))


def events(cluster: Cluster, namespace: str) -> list[tuple[str, str]]:
    items = cluster.kube.list(KINDS["Event"], namespace)
    return [
        (e["reason"], e["message"])
        for e in sorted(items, key=lambda e: e["metadata"]["resourceVersion"])
        if e["involvedObject"]["kind"] == s.KIND
    ]


def track(cluster: Cluster, namespace: str, seconds: float) -> list[tuple[int, int]]:
    """The distinct (prefill, decode) counts seen over `seconds`, in order."""
    return [pd for _, pd in track_times(cluster, namespace, seconds)]


def track_times(cluster: Cluster, namespace: str, seconds: float) -> list[tuple[float, tuple[int, int]]]:
    """(when first seen, (prefill, decode)) of each distinct count over `seconds`."""
    seen: list[tuple[float, tuple[int, int]]] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        now = replicas(cluster, namespace)
        if not seen or seen[-1][1] != now:
            seen.append((time.monotonic(), now))
        time.sleep(0.1)
    return seen


def test_load_up_oscillation_and_down_through_a_drain(
    cluster: Cluster, namespace: str, broker: BrokerServer, scaling_operator: OperatorHandle
) -> None:
    create(cluster, namespace, autoscaled_doc())
    assert wait_for(lambda: replicas(cluster, namespace) == (1, 1), what="workloads at their floor")
    fakes = workers_for(cluster, namespace, broker)
    try:
        for ordinal in range(4):  # the pods a StatefulSet of up to 4 would run
            fakes.add_decode(f"{NAME}-decode-{ordinal}")
        fakes.add_prefill(f"{NAME}-prefill-abc12")
        fakes.add_router(f"{NAME}-router-xyz34")
        key = f"{namespace}/{NAME}"
        wait_for(lambda: len(broker.registry.members(key)) == 6, what="six fake workers registered")

        # 1. Load steps up: both roles go up within the 2 s up window plus an interval or two.
        fakes.traffic.set_rate(3.0)
        stepped = time.monotonic()
        wait_for(lambda: replicas(cluster, namespace) == (3, 3), timeout=15, what="3 prefill, 3 decode")
        assert time.monotonic() - stepped < 8, "the scale-up took longer than a few planner intervals"
        # The status is written after the workloads in the same planner step: a reader can see
        # the StatefulSet first (a cold first run did), so wait for it.
        status = wait_for(
            lambda: (
                (st := cluster.get(s.KIND, namespace, NAME).get("status") or {}).get("autoscaling", {}).get("summary")
                == "P:3 D:3"
                and st
            ),
            timeout=5,
            what="status at P:3 D:3",
        )
        auto = status["autoscaling"]
        assert auto["decode"]["current"] == 3 and auto["decode"]["desired"] == 3
        assert auto["decode"]["driver"] == "planner" and auto["decode"]["lastChangeTime"]
        assert status["decode"]["desired"] == 3 and status["prefill"]["desired"] == 3  # the printer columns' desired
        assert auto["summary"] == "P:3 D:3"
        ups = [m for r, m in events(cluster, namespace) if r == "ScaledUp"]
        assert any(m.startswith("decode 1 -> 3") for m in ups) and any(m.startswith("prefill 1 -> 3") for m in ups)

        # 2. Load oscillating every 0.5 s, faster than the 4 s down window: at most one change
        # per role per window (the average load is lower, so one step down may come).
        timeline = []
        for i in range(20):
            fakes.traffic.set_rate(0.2 if i % 2 == 0 else 3.0)
            timeline += track_times(cluster, namespace, 0.5)
        flips = [pd for _, pd in timeline]
        for role in (0, 1):
            changes = [t for (t, pd), (_, before) in zip(timeline[1:], timeline) if pd[role] != before[role]]
            assert len(changes) <= 3, f"role {role} changed {len(changes)} times in 10 s: {flips}"
            assert all(b - a >= 4 - 0.5 for a, b in zip(changes, changes[1:])), (
                f"two changes within a window: {timeline}"
            )
        fakes.traffic.set_rate(3.0)  # back up, after the 2 s up window
        wait_for(lambda: replicas(cluster, namespace) == (3, 3), timeout=10, what="back at 3, 3")
        # Steady high load for a whole down window: the window then holds only its recommendations.
        assert track(cluster, namespace, 4.5) == [(3, 3)]

        # 3. Load falls and stays down; decode group 2 still runs a request: the planner waits
        # the down window, drains decode-1 and decode-2, and lowers the StatefulSet only after
        # decode-2's request finished.
        assert not [m.worker_id for m in broker.registry.members(key) if m.draining], (
            timeline,
            events(cluster, namespace),
        )
        fakes.decode_busy[f"{NAME}-decode-2"] = 1
        fakes.traffic.set_rate(0.1)
        fell = time.monotonic()
        draining = wait_for(
            lambda: sorted(m.worker_id for m in broker.registry.members(key) if m.draining),
            timeout=20,
            what="decodes marked draining",
        )
        # The window holds recommendations, each made from the last 1 s interval's traffic: the
        # last high one may be up to an interval older than the fall.
        assert time.monotonic() - fell >= 4 - 1 - 0.3, "scaled down before the down window passed"
        # The groups that go are the highest ordinals (a StatefulSet removes those first): decode-2
        # and, if the window already allows 1 group, decode-1 too.
        assert draining in ([f"{NAME}-decode-2"], [f"{NAME}-decode-1", f"{NAME}-decode-2"]), draining
        # Prefill comes down too, but only as far as the band allows against the 3 groups still there.
        wait_for(lambda: replicas(cluster, namespace)[0] == 2, timeout=10, what="prefill down to 2")
        held = track(cluster, namespace, 3.0)
        assert held == [(2, 3)], f"decode went down while a draining group was busy, or P:D left the band: {held}"
        assert "DrainingForScaleDown" in [r for r, _ in events(cluster, namespace)]
        reason = cluster.get(s.KIND, namespace, NAME)["status"]["autoscaling"]["decode"]["reason"]
        assert "requests still running" in reason, reason

        fakes.decode_busy[f"{NAME}-decode-2"] = 0  # its request finished
        wait_for(lambda: replicas(cluster, namespace) == (1, 1), timeout=10, what="decode down to 1 after the drain")
        downs = [m for r, m in events(cluster, namespace) if r == "ScaledDown" and m.startswith("decode 3 ->")]
        assert downs and "drained" in downs[0], downs  # the first step down waited for the drain
        assert not [m.worker_id for m in broker.registry.members(key) if m.draining and m.worker_id.endswith("-0")]
        # The band held throughout: every pair seen had 0.5 <= P/D <= 2.
        assert all(0.5 <= p / d <= 2 for p, d in flips + held)
    finally:
        fakes.close()


def test_an_hpa_owned_role_is_never_overwritten(
    cluster: Cluster, namespace: str, broker: BrokerServer, scaling_operator: OperatorHandle
) -> None:
    doc = autoscaled_doc(
        prefill={
            "enabled": True,
            "driver": "hpa",
            "minReplicas": 1,
            "maxReplicas": 6,
            "metric": {
                "type": "Pods",
                "name": "pdserve_prefill_queue_length",
                "target": {"type": "AverageValue", "averageValue": "4"},
            },
        },
        decode={"enabled": True, "driver": "external", "minReplicas": 1, "maxReplicas": 6},
    )
    doc["spec"]["decode"] = {"replicas": 2}
    create(cluster, namespace, doc)
    assert wait_for(lambda: replicas(cluster, namespace) == (1, 2), what="workloads created at their initial counts")
    hpa = wait_for(
        lambda: cluster.kube.get(KINDS["HorizontalPodAutoscaler"], namespace, f"{NAME}-prefill"),
        what="the rendered HPA",
    )
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"{NAME}-prefill"}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 6)
    assert hpa["spec"]["metrics"] == [
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": "pdserve_prefill_queue_length"},
                "target": {"type": "AverageValue", "averageValue": "4"},
            },
        }
    ]
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 4

    # A second field manager (the HPA controller, KEDA) writes the replicas through the scale
    # subresource, as they do.
    for kind, name, value in (("Deployment", f"{NAME}-prefill", 5), ("StatefulSet", f"{NAME}-decode", 4)):
        cluster.kube.request(
            "PATCH",
            KINDS[kind].path(namespace, name, "scale"),
            {"spec": {"replicas": value}},
            "application/merge-patch+json",
            {"fieldManager": "horizontal-pod-autoscaler"},
        )
    # The operator reconciles again and again (a spec change, resyncs every second, child events).
    cluster.kube.merge_patch(KINDS[s.KIND], namespace, NAME, {"spec": {"router": {"replicas": 2}}})
    wait_for(
        lambda: (cluster.get("Deployment", namespace, f"{NAME}-router") or {}).get("spec", {}).get("replicas") == 2,
        what="the spec change reconciled",
    )
    seen = track(cluster, namespace, 3.0)
    assert seen == [(5, 4)], f"the operator overwrote an autoscaler's replicas: {seen}"
    # Field ownership as the API server records it (the emulator's managed_fields.py): the
    # replicas are the second manager's alone; the operator still owns the rest of the workload.
    for kind, name in (("Deployment", f"{NAME}-prefill"), ("StatefulSet", f"{NAME}-decode")):
        live = cluster.get(kind, namespace, name)
        assert owners(live, ("spec", "replicas")) == ["horizontal-pod-autoscaler"], live["metadata"]["managedFields"]
        assert owners(live, ("spec", "template", "spec", "containers")) == ["OpenAPI-Generator"]
    status = cluster.get(s.KIND, namespace, NAME)["status"]
    assert status["autoscaling"]["prefill"]["driver"] == "hpa" and status["autoscaling"]["prefill"]["current"] == 5
    assert status["autoscaling"]["decode"]["driver"] == "external" and status["decode"]["desired"] == 4

    # Handing prefill to the planner removes the operator's HPA, so the two never fight.
    cluster.kube.merge_patch(
        KINDS[s.KIND], namespace, NAME, {"spec": {"autoscaling": {"prefill": {"driver": "planner", "metric": None}}}}
    )
    wait_for(
        lambda: cluster.kube.get(KINDS["HorizontalPodAutoscaler"], namespace, f"{NAME}-prefill") is None,
        what="the HPA removed",
    )


class MigratingDecodes(FakeWorkers):
    """Decodes that act on the operator's mark as a real one does (worker_main
    `drain_marked`): a short while after the mark, their running requests have moved
    (`moved` migrated, `resumed` fell back to re-prefill), and they report it at once."""

    def __init__(self, *args: Any, drain_s: float, moved: int, resumed: int) -> None:
        super().__init__(*args)
        self.drain_s, self.moved, self.resumed = drain_s, moved, resumed
        self.counts: dict[str, tuple[int, int]] = {}
        self.marked: list[str] = []

    def add_migrating_decode(self, worker_id: str, busy: int) -> None:
        layout = KVLayout(num_slots=8, num_layers=2, max_len=16, kv_heads=1, head_dim=8, dtype="float32")
        info = MemberInfo(
            worker_id=worker_id,
            role=Role.DECODE,
            grpc_endpoint="127.0.0.1:7000",
            engine_id="127.0.0.1:7100",
            regions=(MemoryRegion(0x10000, layout.total_bytes),),
            kv_layout=layout,
            revision="r1",
            slots_total=8,
            slots_free=8,
        )
        self.decode_busy[worker_id], self.counts[worker_id] = busy, (0, 0)

        def load() -> Load:
            n = self.decode_busy[worker_id]
            migrated, fallbacks = self.counts[worker_id]
            return Load(
                slots_used=n, slots_free=8 - n, active_requests=n, migrated=migrated, migration_fallbacks=fallbacks
            )

        async def drain() -> None:
            await asyncio.sleep(self.drain_s)
            self.counts[worker_id], self.decode_busy[worker_id] = (self.moved, self.resumed), 0
            await self.clients[worker_id].report_now()

        def on_mark() -> None:
            self.marked.append(worker_id)
            self.loop.create_task(drain())

        async def go() -> BrokerClient:
            client = BrokerClient(self.address, self.service, self.token)
            await client.register(info, load=load, timeout_s=10, on_marked_draining=on_mark)
            return client

        self.clients[worker_id] = self._run(go())


def test_kubectl_scale_down_drains_the_decode_first_and_reports_its_migrations(
    cluster: Cluster, namespace: str, broker: BrokerServer, scaling_operator: OperatorHandle
) -> None:
    """Issue #17: `kubectl scale` down with no autoscaler → the group that goes is marked
    draining, acts on the mark, and the StatefulSet is lowered only once its running requests
    are 0; a DecodeDrained Event and status.lastDrain carry its migration counts."""
    doc = {
        "apiVersion": s.API_VERSION,
        "kind": s.KIND,
        "metadata": {"name": NAME},
        "spec": {"model": {"maxLength": 1024}, "decode": {"replicas": 2, "drainTimeoutSeconds": 60}},
    }
    create(cluster, namespace, doc)
    wait_for(lambda: replicas(cluster, namespace)[1] == 2, what="two decode replicas")
    secret = wait_for(lambda: cluster.get("Secret", namespace, f"{NAME}-broker-token"), what="the broker token")
    token = base64.b64decode(secret["data"]["token"]).decode()
    workers = MigratingDecodes(
        f"127.0.0.1:{broker.port}", f"{namespace}/{NAME}", token, drain_s=3.0, moved=4, resumed=1
    )
    key, victim, kept = f"{namespace}/{NAME}", f"{NAME}-decode-1", f"{NAME}-decode-0"
    try:
        workers.add_migrating_decode(kept, busy=2)
        workers.add_migrating_decode(victim, busy=5)
        wait_for(
            lambda: sorted(m.load.active_requests for m in broker.registry.members(key)) == [2, 5],
            what="two fake decodes registered, their loads reported",
        )

        cluster.kubectl("scale", f"{s.PLURAL}/{NAME}", "-n", namespace, "--replicas=1")
        wait_for(lambda: workers.marked, timeout=20, what="the victim acting on its mark")
        assert workers.marked == [victim]
        assert [m.worker_id for m in broker.registry.members(key) if m.draining] == [victim]
        assert replicas(cluster, namespace)[1] == 2  # held while the victim's requests move
        seen = track(cluster, namespace, 1.5)
        assert [d for _, d in seen] == [2], f"the StatefulSet went down while the victim was busy: {seen}"

        wait_for(lambda: replicas(cluster, namespace)[1] == 1, timeout=20, what="decode lowered after the drain")
        assert workers.decode_busy[victim] == 0  # lowered only once nothing ran there
        drained = wait_for(
            lambda: [m for r, m in events(cluster, namespace) if r == "DecodeDrained"], what="the DecodeDrained Event"
        )
        assert len(drained) == 1
        assert drained[0].startswith(f"{victim}: 4 requests migrated, 1 resumed by re-prefill; drained in "), drained
        reasons = [r for r, _ in events(cluster, namespace)]
        assert reasons.index("DrainingForScaleDown") < reasons.index("DecodeDrained")
        last = wait_for(
            lambda: cluster.get(s.KIND, namespace, NAME)["status"].get("lastDrain"), what="status.lastDrain"
        )
        assert last["decodes"] == [victim] and last["migrated"] == 4 and last["failed"] == 1
        assert last["running"] == 0 and last["seconds"] >= 2.5 and last["time"]
        assert workers.decode_busy[kept] == 2 and kept not in workers.marked  # the kept group untouched
    finally:
        workers.close()
