"""One reconcile against the recording fake client: exactly which API calls it makes.

In the manner of Kubernetes sample-controller's controller_test.go: seed the fake cluster,
run one reconcile, compare the recorded actions with the expected ones. The fake itself is
held to the real client on the API emulator by test_reconcile_fake_matches_emulator.py.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from pdserve_operator import events as ev
from pdserve_operator import spec as s
from pdserve_operator.kube import KINDS, PDIS, KubeError
from pdserve_operator.reconcile import drift
from pdserve_operator.reconcile.children import render
from pdserve_operator.reconcile.children.autoscaling import scaling_adapter
from pdserve_operator.reconcile.children.meta import (
    Owner,
    owner_reference,
    secret_name,
    selector_labels,
    selector_string,
)
from pdserve_operator.reconcile.children.secret import token_of
from support.kube_fake import DEFAULTS, NOW, Action, Recorder, fake_kube, reconcile, reconciler, service

NS = "team"


def seeded(spec: dict | None = None, name: str = "svc") -> tuple[Recorder, Owner]:
    kube = fake_kube()
    made = kube.inner.create(service(name, NS, spec))
    return kube, Owner(name=name, namespace=NS, uid=made["metadata"]["uid"])


def rendered(owner: Owner, spec: dict | None = None, token: str = "tok-1") -> list[dict]:
    return render(owner, s.parse_spec(spec or {}), token, DEFAULTS)


def status_of(kube: Recorder, name: str = "svc") -> dict:
    obj = kube.inner.get(PDIS, NS, name)
    assert obj is not None
    return obj.get("status") or {}


def condition(status: dict, type_: str) -> dict:
    return next(c for c in status["conditions"] if c["type"] == type_)


def test_an_empty_namespace_gets_every_child_created_and_one_status_patch() -> None:
    kube, owner = seeded()
    out = reconcile(reconciler(kube), NS, "svc")

    children = rendered(owner)
    adapters = [scaling_adapter(owner, role, 1) for role in ("prefill", "decode")]
    expected = [Action("get", s.KIND, NS, "svc")]
    for obj in adapters:  # first, so that a scaled adapter moves the spec this reconcile works from
        expected += [Action("get", obj["kind"], NS, obj["metadata"]["name"])]
        expected += [Action("create", obj["kind"], NS, obj["metadata"]["name"], body=obj)]
    expected.append(Action("get", "Secret", NS, secret_name("svc")))
    for obj in children:
        name = obj["metadata"]["name"]
        if obj["kind"] != "Secret":  # read once already, for the token
            expected.append(Action("get", obj["kind"], NS, name))
        expected.append(Action("create", obj["kind"], NS, name, body=obj))
    assert kube.actions[:-4] == expected
    *reports, patch, event = kube.actions[-4:]
    assert [(a.verb, a.kind, a.name, a.sub) for a in reports] == [
        ("patch", "PDScalingAdapter", f"svc-{role}", "status") for role in ("prefill", "decode")
    ]
    assert reports[0].body == {
        "status": {"replicas": 0, "selector": selector_string("svc", "prefill"), "observedGeneration": 1}
    }
    assert (patch.verb, patch.kind, patch.name, patch.sub) == ("patch", s.KIND, "svc", "status")
    assert patch.body["status"]["phase"] == "Pending" and patch.body["status"]["observedGeneration"] == 1
    assert event == Action("event", s.KIND, NS, "svc", body=(ev.NORMAL, ev.PHASE_PENDING, event.body[2]))
    assert [a.verb for a in kube.writes()] == ["create"] * (len(children) + 2) + ["patch"] * 3 + ["event"]
    assert out is not None and out.created == [f"{o['kind']}/{o['metadata']['name']}" for o in children]
    assert out.status_written and out.phase == "Pending" and not out.patched and not out.conflicts
    assert status_of(kube)["phase"] == "Pending"


def test_a_second_run_on_the_result_writes_nothing() -> None:
    kube, _ = seeded()
    rec = reconciler(kube)
    reconcile(rec, NS, "svc")
    kube.clear()
    out = reconcile(rec, NS, "svc")
    assert kube.writes() == []
    assert {a.verb for a in kube.actions} == {"get"}
    assert out is not None and not out.created and not out.patched and not out.status_written
    # The token came back from the Secret: the factory's next token (tok-2) was never used.
    assert rec.broker.tokens == {f"{NS}/svc": "tok-1"}  # type: ignore[attr-defined]


def test_a_409_on_create_reads_the_child_again_and_patches_only_what_differs() -> None:
    kube, owner = seeded()
    config = next(o for o in rendered(owner) if o["kind"] == "ConfigMap")
    cname = config["metadata"]["name"]
    raced = {**config, "data": {**config["data"], "extra": "someone else's"}}
    raced["data"][next(iter(config["data"]))] = "edited"
    kube.on("create", "ConfigMap", cname, before=lambda inner: inner.create(raced))

    out = reconcile(reconciler(kube), NS, "svc")

    mine = [a for a in kube.actions if (a.kind, a.name) == ("ConfigMap", cname)]
    assert [a.verb for a in mine] == ["get", "create", "get", "patch"]
    assert mine[-1].body == drift.merge_patch(config)
    assert out is not None and f"ConfigMap/{cname}" not in out.created and out.patched == [f"ConfigMap/{cname}"]
    live = kube.inner.get(KINDS["ConfigMap"], NS, cname)
    assert live is not None and live["data"] == {**config["data"], "extra": "someone else's"}  # ours back, theirs kept
    # The spec was new (no status yet): that patch is this reconcile's own work, not a reverted edit.
    assert not [a for a in kube.actions if a.verb == "event" and a.body[1] == ev.DRIFT_REVERTED]


def test_a_409_for_a_child_that_is_gone_again_fails_the_reconcile_for_a_retry() -> None:
    kube, owner = seeded()
    conflict = KubeError(409, "AlreadyExists", 'configmaps "svc-config" already exists', "POST", "/api/v1/...")
    kube.on("create", "ConfigMap", error=conflict)
    with pytest.raises(KubeError) as caught:
        reconcile(reconciler(kube), NS, "svc")
    assert caught.value.status == 409
    mine = [a.verb for a in kube.actions if a.kind == "ConfigMap"]
    assert mine == ["get", "create", "get"]
    assert not [a for a in kube.actions if a.sub == "status"]  # the retry writes the status


def test_a_child_controlled_by_another_owner_is_not_written_and_degrades_the_service() -> None:
    kube, owner = seeded()
    router_svc = next(o for o in rendered(owner) if o["kind"] == "Service" and o["metadata"]["name"] == "svc")
    theirs = {
        **router_svc,
        "metadata": {
            **router_svc["metadata"],
            "ownerReferences": [
                {"apiVersion": "apps/v1", "kind": "Deployment", "name": "other", "uid": "other-uid", "controller": True}
            ],
        },
        "spec": {"selector": {"app": "other"}, "ports": [{"port": 1}]},
    }
    kube.inner.create(theirs)

    out = reconcile(reconciler(kube), NS, "svc")

    assert [a.verb for a in kube.actions if (a.kind, a.name) == ("Service", "svc")] == ["get"]
    assert out is not None and out.conflicts == ["Service/svc"] and out.phase == "Degraded"
    status = status_of(kube)
    degraded = condition(status, "Degraded")
    assert status["phase"] == "Degraded" and degraded["status"] == "True"
    assert "Service/svc is owned by another controller" in degraded["message"]
    events = [a.body for a in kube.actions if a.verb == "event"]
    assert events == [(ev.WARNING, ev.DEGRADED, events[0][2])] and "Service/svc" in events[0][2]
    live = kube.inner.get(KINDS["Service"], NS, "svc")
    assert live is not None and live["spec"] == theirs["spec"]
    # Every other child was created as usual.
    assert len(out.created) == len(rendered(owner)) - 1


def test_drift_by_someone_else_is_patched_back_with_an_event() -> None:
    kube, owner = seeded()
    rec = reconciler(kube)
    reconcile(rec, NS, "svc")
    sts, dep = KINDS["StatefulSet"], KINDS["Deployment"]
    kube.inner.merge_patch(sts, NS, "svc-decode", {"spec": {"replicas": 7}})
    prefill = kube.inner.get(dep, NS, "svc-prefill")
    assert prefill is not None
    container = prefill["spec"]["template"]["spec"]["containers"][0]
    container["env"] = [e for e in container["env"] if e["name"] != "PDSERVE_ROLE"] + [{"name": "X", "value": "1"}]
    kube.inner.merge_patch(dep, NS, "svc-prefill", {"spec": prefill["spec"]})
    kube.clear()

    out = reconcile(rec, NS, "svc")

    want = {o["metadata"]["name"]: o for o in rendered(owner) if o["kind"] in ("Deployment", "StatefulSet")}
    writes = kube.writes()
    assert [a.short() for a in writes] == [
        "patch Deployment/svc-prefill",
        f"event {s.KIND}/svc {ev.DRIFT_REVERTED}",
        "patch StatefulSet/svc-decode",
        f"event {s.KIND}/svc {ev.DRIFT_REVERTED}",
    ]
    assert writes[0].body == drift.merge_patch(want["svc-prefill"])
    assert writes[2].body == drift.merge_patch(want["svc-decode"])
    assert writes[1].body[0] == ev.WARNING
    assert "Deployment/svc-prefill: reverted spec.template.spec" in writes[1].body[2]
    assert "StatefulSet/svc-decode: reverted spec.replicas" in writes[3].body[2]
    assert out is not None and out.patched == ["Deployment/svc-prefill", "StatefulSet/svc-decode"]
    for name, obj in want.items():
        live = kube.inner.get(KINDS[obj["kind"]], NS, name)
        assert live is not None and drift.content_drift(obj, live) == []


def test_a_spec_change_patches_children_without_calling_it_drift() -> None:
    kube, owner = seeded()
    rec = reconciler(kube)
    reconcile(rec, NS, "svc")
    kube.inner.merge_patch(PDIS, NS, "svc", {"spec": {"decode": {"replicas": 3}}})
    kube.clear()
    out = reconcile(rec, NS, "svc")
    assert [a.short() for a in kube.writes()] == [
        "patch PDScalingAdapter/svc-decode",  # the service moved: its adapter follows
        "patch StatefulSet/svc-decode",
        "patch PDScalingAdapter/svc-decode/status",
        f"patch {s.KIND}/svc/status",
    ]
    assert kube.writes()[0].body["spec"]["replicas"] == 3 and kube.writes()[1].body["spec"]["replicas"] == 3
    assert out is not None and status_of(kube)["observedGeneration"] == 2


def test_an_invalid_spec_writes_only_the_status() -> None:
    # Passes the CRD's schema; the operator knows the built-in model has 30 layers.
    kube, _ = seeded({"decode": {"layerShards": 31}})
    out = reconcile(reconciler(kube), NS, "svc")
    assert [a.short() for a in kube.actions] == [
        f"get {s.KIND}/svc",
        f"patch {s.KIND}/svc/status",
        f"event {s.KIND}/svc {ev.INVALID_SPEC}",
    ]
    status = status_of(kube)
    valid = condition(status, "SpecValid")
    assert status["phase"] == "Invalid" and valid["status"] == "False" and "decode.layerShards" in valid["message"]
    assert valid["lastTransitionTime"] == NOW
    assert out is not None and out.phase == "Invalid"


def test_a_spec_turning_invalid_leaves_the_children_as_they_were() -> None:
    kube, _ = seeded()
    rec = reconciler(kube)
    reconcile(rec, NS, "svc")
    kube.inner.merge_patch(PDIS, NS, "svc", {"spec": {"decode": {"layerShards": 31}}})
    kube.clear()
    reconcile(rec, NS, "svc")
    assert [a.short() for a in kube.writes()] == [f"patch {s.KIND}/svc/status", f"event {s.KIND}/svc {ev.INVALID_SPEC}"]
    assert all(a.kind == s.KIND for a in kube.actions)


def test_a_name_too_long_for_the_children_is_invalid() -> None:
    name = "n" * (s.MAX_NAME_LENGTH + 1)
    kube, _ = seeded(name=name)
    out = reconcile(reconciler(kube), NS, name)
    assert out is not None and out.phase == "Invalid"
    assert [a.verb for a in kube.writes()] == ["patch", "event"]
    assert "metadata.name" in condition(status_of(kube, name), "SpecValid")["message"]


def test_a_failed_event_post_does_not_fail_the_reconcile() -> None:
    kube, _ = seeded()
    kube.on("event", s.KIND, error=KubeError(403, "Forbidden", "events is forbidden", "POST", "/api/v1/..."))
    out = reconcile(reconciler(kube), NS, "svc")
    assert out is not None and out.status_written and status_of(kube)["phase"] == "Pending"


def test_a_resource_gone_or_being_deleted_is_left_to_the_garbage_collector() -> None:
    kube = fake_kube()
    assert reconcile(reconciler(kube), NS, "svc") is None
    doc = service("svc", NS)
    doc["metadata"].update(deletionTimestamp=NOW, finalizers=["pdserve.dev/finalizer"])
    kube.inner.create(doc)
    kube.clear()
    assert reconcile(reconciler(kube), NS, "svc") is None
    assert kube.actions == [Action("get", s.KIND, NS, "svc")]


def test_sharded_decode_lists_its_pods_to_count_complete_groups() -> None:
    kube, owner = seeded({"decode": {"replicas": 2, "layerShards": 2}})
    pods = KINDS["Pod"]
    labels, selector = selector_labels("svc", "decode"), selector_string("svc", "decode")
    for ordinal in range(4):  # group 0 complete, group 1 half ready
        ready = "True" if ordinal < 3 else "False"
        kube.inner.create(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": f"svc-decode-{ordinal}", "namespace": NS, "labels": labels},
            }
        )
        kube.inner.merge_patch(
            pods,
            NS,
            f"svc-decode-{ordinal}",
            {"status": {"conditions": [{"type": "Ready", "status": ready}]}},
            "status",
        )
    kube.inner.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "other-0", "namespace": NS}})
    reconcile(reconciler(kube), NS, "svc")
    assert Action("list", "Pod", NS, None, body=selector) in kube.actions
    assert status_of(kube)["decode"]["ready"] == 1


def test_requests_during_a_reconcile_collapse_into_one_follow_up() -> None:
    kube, _ = seeded()
    rec = reconciler(kube)
    entered, release = threading.Event(), threading.Event()

    def hold(_: object) -> None:
        entered.set()
        assert release.wait(10)

    kube.on("get", s.KIND, "svc", before=hold)  # the first run stops in its first call

    async def main() -> list[object]:
        first = asyncio.create_task(rec.request(NS, "svc", "a"))
        await asyncio.to_thread(entered.wait, 10)
        queued = [asyncio.create_task(rec.request(NS, "svc", why)) for why in ("b", "c", "d")]
        await asyncio.sleep(0.05)
        release.set()
        return list(await asyncio.gather(first, *queued))

    first, *queued = asyncio.run(main())
    assert first is not None and first.created  # type: ignore[attr-defined]
    assert [q is None for q in queued] == [False, True, True]  # b runs once more; c and d ride along
    assert [a.short() for a in kube.actions].count(f"get {s.KIND}/svc") == 2


def test_a_broker_token_secret_owned_by_someone_else_is_not_trusted() -> None:
    kube, owner = seeded()
    planted = next(o for o in rendered(owner, token="chosen-by-them") if o["kind"] == "Secret")
    planted["metadata"]["ownerReferences"] = [
        {"apiVersion": "v1", "kind": "ConfigMap", "name": "theirs", "uid": "their-uid", "controller": True}
    ]
    kube.inner.create(planted)
    rec = reconciler(kube)
    out = reconcile(rec, NS, "svc")
    assert rec.broker.tokens == {f"{NS}/svc": "tok-1"}  # type: ignore[attr-defined]
    secret = secret_name("svc")
    assert out is not None and out.conflicts == [f"Secret/{secret}"] and out.phase == "Degraded"
    assert [a.verb for a in kube.actions if a.kind == "Secret"] == ["get"]


def test_an_orphaned_broker_token_secret_is_adopted_with_its_token() -> None:
    """Like the ownerReference removed by hand: running pods hold that token, so it stays."""
    kube, owner = seeded()
    orphan = next(o for o in rendered(owner, token="kept") if o["kind"] == "Secret")
    del orphan["metadata"]["ownerReferences"]
    kube.inner.create(orphan)
    rec = reconciler(kube)
    reconcile(rec, NS, "svc")
    assert rec.broker.tokens == {f"{NS}/svc": "kept"}  # type: ignore[attr-defined]
    live = kube.inner.get(KINDS["Secret"], NS, secret_name("svc"))
    assert live is not None and token_of(live) == "kept"
    assert live["metadata"]["ownerReferences"] == [owner_reference(owner)]
