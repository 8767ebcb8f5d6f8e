"""PDScalingAdapter ↔ spec.<role>.replicas: who wins, and every refusal's path (scaling_adapters.py)."""

from __future__ import annotations

from pdserve_operator import spec as s
from pdserve_operator.kube import KINDS, PDIS, KubeError
from pdserve_operator.reconcile.children.autoscaling import scaling_adapter
from pdserve_operator.reconcile.children.meta import Owner
from pdserve_operator.reconcile.scaling_adapters import ADAPTER_IGNORED, CRD_RECHECK_S, SCALE_REFUSED, Decision, decide
from support.kube_fake import fake_kube, reconcile, reconciler, service

ADAPTER = KINDS["PDScalingAdapter"]
NS = "team"


def adapter(replicas: int, generation: int, observed: int | None) -> dict:
    obj = {"metadata": {"generation": generation}, "spec": {"replicas": replicas}}
    if observed is not None:
        obj["status"] = {"observedGeneration": observed}
    return obj


def test_decide_takes_the_side_that_moved() -> None:
    assert decide(adapter(2, 3, 3), 2) == Decision()  # equal: nothing to do, whatever the generations
    assert decide(adapter(2, 4, 3), 2) == Decision()
    assert decide(adapter(5, 4, 3), 2) == Decision(to_service=5)  # scaled since the last sync: the adapter wins
    assert decide(adapter(5, 3, 3), 2) == Decision(to_adapter=2)  # the service moved: the adapter follows
    # Never synced (no status): the service's own spec wins over an adapter nobody has taken yet.
    assert decide(adapter(5, 1, None), 2) == Decision(to_adapter=2)


def synced(spec: dict | None = None):  # type: ignore[no-untyped-def]
    kube = fake_kube()
    kube.inner.create(service("svc", NS, spec))
    rec = reconciler(kube)
    reconcile(rec, NS, "svc")
    return kube, rec


def test_a_scaled_prefill_adapter_moves_the_spec_and_the_deployment() -> None:
    kube, rec = synced()
    kube.inner.merge_patch(ADAPTER, NS, "svc-prefill", {"spec": {"replicas": 4}})
    kube.clear()
    reconcile(rec, NS, "svc")
    writes = [a.short() for a in kube.writes()]
    assert writes[:2] == [f"patch {s.KIND}/svc", "patch Deployment/svc-prefill"], writes
    assert kube.writes()[0].body == {"spec": {"prefill": {"replicas": 4}}}
    assert kube.inner.get(KINDS["Deployment"], NS, "svc-prefill")["spec"]["replicas"] == 4
    live = kube.inner.get(ADAPTER, NS, "svc-prefill")
    assert live["status"]["observedGeneration"] == live["metadata"]["generation"] == 2
    kube.clear()
    reconcile(rec, NS, "svc")  # taken: the next run writes nothing
    assert kube.writes() == []


def test_a_scale_the_service_refuses_is_an_event_and_the_adapter_goes_back() -> None:
    kube, rec = synced()
    kube.inner.merge_patch(ADAPTER, NS, "svc-decode", {"spec": {"replicas": 9}})
    refused = KubeError(422, "Invalid", "spec.decode.replicas: must not exceed maxReplicas", "PATCH", "/apis/...")
    kube.on("patch", s.KIND, "svc", error=refused)
    kube.clear()
    reconcile(rec, NS, "svc")
    events = [e for e in kube.inner.events if e[3] == SCALE_REFUSED]
    assert len(events) == 1 and "PDScalingAdapter/svc-decode: replicas 9 refused" in events[0][4]
    live = kube.inner.get(ADAPTER, NS, "svc-decode")
    assert live["spec"]["replicas"] == 1 and live["status"]["observedGeneration"] == live["metadata"]["generation"]
    assert kube.inner.get(KINDS["StatefulSet"], NS, "svc-decode")["spec"]["replicas"] == 1


def test_a_scale_between_our_read_and_our_write_is_not_overwritten() -> None:
    kube, rec = synced()
    kube.inner.merge_patch(PDIS, NS, "svc", {"spec": {"decode": {"replicas": 2}}})  # the service moved...
    # ...and an HPA scales the adapter right after our read: our patch carries the old resourceVersion.
    kube.on(
        "patch",
        "PDScalingAdapter",
        "svc-decode",
        before=lambda inner: inner.merge_patch(ADAPTER, NS, "svc-decode", {"spec": {"replicas": 3}}),
    )
    reconcile(rec, NS, "svc")
    assert kube.inner.get(ADAPTER, NS, "svc-decode")["spec"]["replicas"] == 3  # the HPA's, kept
    reconcile(rec, NS, "svc")  # the next run lets the newer scale win
    assert kube.inner.get(PDIS, NS, "svc")["spec"]["decode"]["replicas"] == 3


def test_without_the_adapter_crd_the_service_is_served_and_told_once() -> None:
    kube = fake_kube()
    kube.inner.create(service("svc", NS))
    missing = KubeError(404, "NotFound", "the server could not find the requested resource", "POST", "/apis/...")
    kube.on("create", "PDScalingAdapter", error=missing, times=-1)
    rec = reconciler(kube)
    out = reconcile(rec, NS, "svc")
    assert out is not None and "Deployment/svc-prefill" in out.created
    assert [a.verb for a in kube.actions if a.kind == "PDScalingAdapter"] == ["get", "create"]  # not per role
    # Nor per reconcile: the next ones do not ask again until the recheck is due.
    now = [0.0]
    rec.adapters.monotonic = lambda: now[0]
    rec.adapters._missing[f"{NS}/svc"] = now[0] + CRD_RECHECK_S
    kube.clear()
    reconcile(rec, NS, "svc")
    assert [a for a in kube.actions if a.kind == "PDScalingAdapter"] == []
    now[0] += CRD_RECHECK_S  # due: it looks again, and finds the CRD installed meanwhile
    kube.reactors.clear()
    reconcile(rec, NS, "svc")
    verbs = [a.verb for a in kube.actions if a.kind == "PDScalingAdapter"]
    assert verbs[:4] == ["get", "create", "get", "create"]  # both made (then their status written)
    assert kube.inner.get(ADAPTER, NS, "svc-prefill") is not None


def test_an_adapter_another_controller_owns_is_left_alone() -> None:
    kube = fake_kube()
    kube.inner.create(service("svc", NS))
    theirs = scaling_adapter(Owner("svc", NS, "someone-else"), "prefill", 7)
    kube.inner.create(theirs)
    reconcile(reconciler(kube), NS, "svc")
    assert [a.verb for a in kube.actions if (a.kind, a.name) == ("PDScalingAdapter", "svc-prefill")] == ["get"]
    assert kube.inner.get(PDIS, NS, "svc")["spec"] == {}  # its 7 never reached the service
    assert kube.inner.get(ADAPTER, NS, "svc-decode") is not None


def test_a_scale_of_a_role_an_external_autoscaler_owns_is_said_to_change_nothing() -> None:
    spec = {"autoscaling": {"prefill": {"enabled": True, "driver": "external"}}}
    kube, rec = synced(spec)
    kube.inner.merge_patch(ADAPTER, NS, "svc-prefill", {"spec": {"replicas": 3}})
    reconcile(rec, NS, "svc")
    ignored = [e for e in kube.inner.events if e[3] == ADAPTER_IGNORED]
    assert len(ignored) == 1 and "autoscaling.prefill.driver external" in ignored[0][4]
    assert kube.inner.get(KINDS["Deployment"], NS, "svc-prefill")["spec"]["replicas"] == 1  # not the operator's to set
    kube.inner.merge_patch(ADAPTER, NS, "svc-decode", {"spec": {"replicas": 2}})  # decode: no autoscaling
    reconcile(rec, NS, "svc")
    assert len([e for e in kube.inner.events if e[3] == ADAPTER_IGNORED]) == 1
