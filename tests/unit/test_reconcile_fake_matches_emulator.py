"""The fake client cannot drift from reality: one scenario, two clusters, the same API calls.

The reconcile unit tests (test_reconcile.py) trust `MemoryKube` to answer as the API server
does. Here the same scenario (an empty namespace, a second run, a hand edit, a create that
races another writer, a child another controller owns, an invalid spec, a spec change,
layer-sharded decode pods) runs once on the fake and once through the production
`RestKubeClient` on the API emulator (which applies the API server's rules: CRD defaulting,
pruning and validation of the status we write, 409s, generations). Both are wrapped in the
same `Recorder`, so any difference in what the store answers shows up as a difference in the
calls the reconciler makes next.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kube_emulator import EmulatorThread
from pdserve_operator import events as ev
from pdserve_operator import spec as s
from pdserve_operator.crd import build_adapter_crd, build_crd
from pdserve_operator.kube import KINDS, PDIS, KubeClient, RestKubeClient
from pdserve_operator.reconcile.children import render
from pdserve_operator.reconcile.children.meta import Owner, selector_labels
from support.kube_fake import Action, MemoryKube, Recorder, reconcile, reconciler, service

NS = "agree"
Steps = dict[str, list[Action]]


@pytest.fixture(scope="module")
def emulated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RestKubeClient]:
    with EmulatorThread() as emu:
        client = RestKubeClient.from_environment(str(emu.write_kubeconfig(tmp_path_factory.mktemp("kc") / "config")))
        for crd in (build_crd(), build_adapter_crd()):
            client.request("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
        namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}
        client.request("POST", "/api/v1/namespaces", namespace)
        yield client
        client.close()


def _uid(kube: KubeClient, kind: str, name: str) -> str:
    obj = kube.get(PDIS if kind == s.KIND else KINDS[kind], NS, name)
    assert obj is not None
    return str(obj["metadata"]["uid"])


def scenario(kube: Recorder) -> Steps:
    """Each step's recorded actions, with the cluster-assigned uids replaced by names."""
    rec, inner, steps = reconciler(kube), kube.inner, {}
    uids: dict[str, str] = {}

    def step(label: str, name: str, before: Callable[[], Any] = lambda: None) -> None:
        before()
        kube.clear()
        reconcile(rec, NS, name)
        text = json.dumps([a.__dict__ for a in kube.actions], default=list)
        for uid, who in uids.items():
            text = text.replace(uid, f"<uid of {who}>")
        text = re.sub(r'"resourceVersion": "\d+"', '"resourceVersion": "<rv>"', text)  # each server's own counter
        steps[label] = [
            Action(**{**a, "body": tuple(a["body"]) if a["verb"] == "event" else a["body"]}) for a in json.loads(text)
        ]

    def add_service(name: str, spec: dict[str, Any] | None = None) -> Owner:
        inner.create(service(name, NS, spec))
        uids[_uid(inner, s.KIND, name)] = name
        return Owner(name, NS, _uid(inner, s.KIND, name))

    add_service("svc", {"decode": {"layerShards": 2}})
    step("empty namespace", "svc")
    step("second run", "svc")
    sts = KINDS["StatefulSet"]
    step("hand edit", "svc", lambda: inner.merge_patch(sts, NS, "svc-decode", {"spec": {"replicas": 7}}))

    raced = add_service("raced")
    config = next(o for o in render(raced, s.parse_spec({}), "tok-9", rec.defaults) if o["kind"] == "ConfigMap")
    edited = {**config, "data": {k: "edited" for k in config["data"]}}
    kube.on("create", "ConfigMap", config["metadata"]["name"], before=lambda i: i.create(edited))
    step("create raced", "raced")

    foreign = add_service("foreign")
    other = inner.create(
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "other-owner", "namespace": NS}}
    )
    uids[other["metadata"]["uid"]] = "other-owner"
    theirs = next(
        o
        for o in render(foreign, s.parse_spec({}), "x", rec.defaults)
        if o["kind"] == "Service" and o["metadata"]["name"] == "foreign"
    )
    theirs["metadata"]["ownerReferences"] = [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "name": "other-owner",
            "uid": other["metadata"]["uid"],
            "controller": True,
        }
    ]
    step("foreign owner", "foreign", lambda: inner.create(theirs))

    add_service("bad", {"decode": {"layerShards": 31}})
    step("invalid spec", "bad")

    def pods() -> None:
        def pod(name: str, owner: str) -> None:
            inner.create(
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": name, "namespace": NS, "labels": selector_labels(owner, "decode")},
                }
            )
            inner.merge_patch(
                KINDS["Pod"], NS, name, {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}, "status"
            )

        for ordinal in range(3):  # group 0 complete, group 1 half
            pod(f"svc-decode-{ordinal}", "svc")
        pod("raced-decode-3", "raced")  # another service's: would complete group 1 if the selector were ignored

    step("decode pods ready", "svc", pods)
    step("spec change", "svc", lambda: inner.merge_patch(PDIS, NS, "svc", {"spec": {"decode": {"replicas": 2}}}))
    adapter = KINDS["PDScalingAdapter"]
    step("adapter scaled", "svc", lambda: inner.merge_patch(adapter, NS, "svc-prefill", {"spec": {"replicas": 3}}))
    return steps


def test_the_fake_and_the_real_client_on_the_emulator_see_the_same_calls(emulated: RestKubeClient) -> None:
    fake = MemoryKube()
    on_fake, on_emulator = scenario(Recorder(fake)), scenario(Recorder(emulated))

    assert list(on_fake) == list(on_emulator)
    for label in on_fake:
        assert [a.short() for a in on_fake[label]] == [a.short() for a in on_emulator[label]], label
        assert on_fake[label] == on_emulator[label], label

    # The scenario walked every path it names (else the comparison above proves little).
    writes = {label: [a.short() for a in actions if a.write] for label, actions in on_fake.items()}
    assert writes["second run"] == []
    assert writes["hand edit"] == ["patch StatefulSet/svc-decode", f"event {s.KIND}/svc {ev.DRIFT_REVERTED}"]
    assert "patch ConfigMap/raced-config" in writes["create raced"]
    assert [w.split()[1] for w in writes["foreign owner"] if w.split()[1] == "Service/foreign"] == []
    assert f"event {s.KIND}/foreign {ev.DEGRADED}" in writes["foreign owner"]
    assert writes["invalid spec"] == [f"patch {s.KIND}/bad/status", f"event {s.KIND}/bad {ev.INVALID_SPEC}"]
    assert any(a.verb == "list" and a.kind == "Pod" for a in on_fake["decode pods ready"])
    assert writes["adapter scaled"][:2] == [f"patch {s.KIND}/svc", "patch Deployment/svc-prefill"]
    assert writes["decode pods ready"] == [f"patch {s.KIND}/svc/status", f"event {s.KIND}/svc {ev.PHASE_PROGRESSING}"]

    # The Events were stored, by the real poster too, in the order they were posted.
    emulated_events = emulated.list(KINDS["Event"], NS)
    emulated_events.sort(key=lambda e: e["metadata"]["name"].rsplit(".", 1)[1])
    assert [(e["involvedObject"]["name"], e["type"], e["reason"]) for e in emulated_events] == [
        (name, type_, reason) for _, name, type_, reason, _ in fake.events
    ]
    for e in emulated_events:
        assert e["involvedObject"]["uid"] == _uid(emulated, s.KIND, e["involvedObject"]["name"])
        assert e["involvedObject"]["namespace"] == e["metadata"]["namespace"] == NS
