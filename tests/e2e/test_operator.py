"""The real operator (kopf + our handlers) against the API emulator, driven by kubectl and the client."""

from __future__ import annotations

import base64
import time
from pathlib import Path
from typing import Any

import yaml

from conftest import ROOT, Cluster, OperatorHandle, wait_for
from pdserve_operator.kube import KINDS
from pdserve_operator.reconcile.children.meta import (
    LABEL_INSTANCE,
    Owner,
    owner_reference,
    selector_labels,
    selector_string,
)

SAMPLE = ROOT / "manifests" / "samples" / "smollm2-cpu.yaml"
CHILDREN = [
    ("Secret", "{n}-broker-token"),
    ("ConfigMap", "{n}-config"),
    ("Service", "{n}-decode-headless"),
    ("Service", "{n}"),
    ("Deployment", "{n}-prefill"),
    ("StatefulSet", "{n}-decode"),
    ("Deployment", "{n}-router"),
    ("PodDisruptionBudget", "{n}-prefill"),
    ("PodDisruptionBudget", "{n}-decode"),
    ("PodDisruptionBudget", "{n}-router"),
]


def children_of(cluster: Cluster, ns: str, name: str) -> dict[tuple[str, str], dict[str, Any] | None]:
    return {(k, pat.format(n=name)): cluster.get(k, ns, pat.format(n=name)) for k, pat in CHILDREN}


def all_children(cluster: Cluster, ns: str, name: str) -> dict[tuple[str, str], dict[str, Any]] | None:
    found = children_of(cluster, ns, name)
    return None if any(v is None for v in found.values()) else found  # type: ignore[return-value]


def status(cluster: Cluster, ns: str, name: str) -> dict[str, Any]:
    obj = cluster.get("PDInferenceService", ns, name)
    assert obj is not None
    return obj.get("status") or {}


def env_of(workload: dict[str, Any]) -> dict[str, Any]:
    container = workload["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def make_ready(cluster: Cluster, ns: str, name: str, prefill: int, decode_pods: int, router: int) -> None:
    for kind, role, n in (
        ("Deployment", "prefill", prefill),
        ("StatefulSet", "decode", decode_pods),
        ("Deployment", "router", router),
    ):
        obj = cluster.get(kind, ns, f"{name}-{role}")
        assert obj is not None
        cluster.patch_status(
            kind,
            ns,
            f"{name}-{role}",
            {
                "observedGeneration": obj["metadata"]["generation"],
                "replicas": n,
                "readyReplicas": n,
                "updatedReplicas": n,
                "availableReplicas": n,
            },
        )


def apply(cluster: Cluster, ns: str, doc: dict[str, Any], tmp: Path) -> None:
    path = tmp / f"{doc['metadata']['name']}.yaml"
    path.write_text(yaml.safe_dump(doc))
    cluster.kubectl("apply", "--validate=false", "-n", ns, "-f", str(path))


def test_sample_gets_every_child_with_owner_env_and_resources(
    cluster: Cluster, operator: OperatorHandle, namespace: str, tmp_path: Path
) -> None:
    doc = yaml.safe_load(SAMPLE.read_text())
    doc["metadata"]["name"] = "svc"
    doc["spec"]["device"] = {"type": "npu", "resourceName": "huawei.com/Ascend910", "count": 2}
    doc["spec"]["decode"].update(readiness="poll", pollIntervalMicros=50)
    doc["spec"]["prefill"]["env"] = [{"name": "EXTRA", "value": "1"}, {"name": "PDSERVE_ROLE", "value": "evil"}]
    apply(cluster, namespace, doc, tmp_path)
    kids = wait_for(lambda: all_children(cluster, namespace, "svc"), what="all children")
    owner = cluster.get("PDInferenceService", namespace, "svc")
    assert owner is not None
    for (kind, name), obj in kids.items():
        refs = obj["metadata"]["ownerReferences"]
        assert refs == [owner_reference(Owner("svc", namespace, owner["metadata"]["uid"]))], (kind, name)
        assert obj["metadata"]["labels"][LABEL_INSTANCE] == "svc"

    decode = kids[("StatefulSet", "svc-decode")]
    env = env_of(decode)
    assert env["PDSERVE_ROLE"] == "decode"
    assert env["PDSERVE_SERVICE"] == f"{namespace}/svc"
    # Each pod its role's token and what its role needs from the Secret, never the service token (#29).
    assert env["PDSERVE_BROKER_TOKEN"] == {"secretKeyRef": {"name": "svc-broker-token", "key": "token-decode"}}
    assert env["PDSERVE_KV_CAPABILITY_KEY"] == {
        "secretKeyRef": {"name": "svc-broker-token", "key": "kv-capability-key"}
    }
    router_env = env_of(kids[("Deployment", "svc-router")])
    assert router_env["PDSERVE_BROKER_TOKEN"]["secretKeyRef"]["key"] == "token-router"
    assert not {"PDSERVE_KV_LINK_KEY", "PDSERVE_KV_CAPABILITY_KEY"} & set(router_env)
    every_key = {
        ref["secretKeyRef"]["key"]
        for kind, name in (("StatefulSet", "svc-decode"), ("Deployment", "svc-prefill"), ("Deployment", "svc-router"))
        for ref in env_of(kids[(kind, name)]).values()
        if isinstance(ref, dict) and "secretKeyRef" in ref
    }
    assert "token" not in every_key
    assert env["PDSERVE_READINESS_MODE"] == "poll" and env["PDSERVE_POLL_INTERVAL_MICROS"] == "50"
    assert env["PDSERVE_TRANSFER_BACKEND"] == "cpu" and env["PDSERVE_SLOTS"] == "8"
    container = decode["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["huawei.com/Ascend910"] == "2"
    assert container["image"] == "registry.example/pdserve:test"
    assert container["lifecycle"]["preStop"] == {"exec": {"command": ["pdserve", "drain"]}}
    prefill_env = env_of(kids[("Deployment", "svc-prefill")])
    assert prefill_env["PDSERVE_ROLE"] == "prefill" and prefill_env["EXTRA"] == "1"
    assert "huawei.com/Ascend910" not in (
        kids[("Deployment", "svc-router")]["spec"]["template"]["spec"]["containers"][0]
        .get("resources", {})
        .get("limits", {})
    )

    # The token in the Secret is the one the broker was told, and it is kept across reconciles.
    data = {k: base64.b64decode(v).decode() for k, v in kids[("Secret", "svc-broker-token")]["data"].items()}
    token = data["token"]
    assert operator.broker.tokens[f"{namespace}/svc"] == token and len(token) >= 32
    from pdserve_common.auth import role_token

    assert data["token-decode"] == role_token(token, "decode") and data["token-router"] == role_token(token, "router")

    st = wait_for(lambda: status(cluster, namespace, "svc").get("phase"), what="a status")
    assert st == "Pending"
    operator.broker.counts[f"{namespace}/svc"] = {"prefill": 1, "decode": 1, "router": 1}
    operator.broker.slots[f"{namespace}/svc"] = 3
    make_ready(cluster, namespace, "svc", 1, 1, 1)
    final = wait_for(lambda: (s := status(cluster, namespace, "svc")).get("phase") == "Ready" and s, what="Ready")
    assert final["prefill"] == {"desired": 1, "ready": 1, "registered": 1, "summary": "1/1"}
    assert final["decode"]["summary"] == "1/1" and final["decode"]["replicas"] == 1
    assert final["slots"] == {"used": 3, "total": 8, "summary": "3/8"}
    assert final["endpoint"] == f"http://svc.{namespace}.svc:8000/v1"
    conds = {c["type"]: c["status"] for c in final["conditions"]}
    assert conds == {"Ready": "True", "SpecValid": "True", "Progressing": "False", "Degraded": "False"}
    assert base64.b64decode(cluster.get("Secret", namespace, "svc-broker-token")["data"]["token"]).decode() == token

    table = cluster.kubectl("get", "pdis", "svc", "-n", namespace).stdout
    assert "PREFILL" in table and "Ready" in table and "3/8" in table, table
    events = cluster.kube.request("GET", f"/api/v1/namespaces/{namespace}/events")["items"]
    assert any(e.get("reason") == "PhaseReady" for e in events), [e.get("reason") for e in events]

    # Losing pods without a spec change is a degradation, not progress.
    cluster.patch_status("Deployment", namespace, "svc-router", {"readyReplicas": 0})
    wait_for(lambda: status(cluster, namespace, "svc").get("phase") == "Degraded", what="Degraded")


def test_kubectl_scale_drives_the_statefulset_and_status(
    cluster: Cluster, operator: OperatorHandle, namespace: str, tmp_path: Path
) -> None:
    doc = yaml.safe_load(SAMPLE.read_text())
    doc["spec"]["decode"]["layerShards"] = 2
    apply(cluster, namespace, doc, tmp_path)
    sts = wait_for(lambda: cluster.get("StatefulSet", namespace, "smollm2-decode"), what="decode StatefulSet")
    assert sts["spec"]["replicas"] == 2  # one group of two shards
    assert env_of(sts)["PDSERVE_LAYER_SHARDS"] == "2"

    cluster.kubectl("scale", "pdis/smollm2", "--replicas=3", "-n", namespace)
    wait_for(
        lambda: cluster.get("StatefulSet", namespace, "smollm2-decode")["spec"]["replicas"] == 6, what="6 decode pods"
    )
    wait_for(
        lambda: status(cluster, namespace, "smollm2").get("decode", {}).get("desired") == 3, what="status desired 3"
    )
    # Play the StatefulSet controller: six pods, one of group 2 not ready yet.
    for ordinal in range(6):
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": f"smollm2-decode-{ordinal}",
                "namespace": namespace,
                "labels": selector_labels("smollm2", "decode"),
            },
            "spec": {"containers": [{"name": "worker", "image": "x"}]},
        }
        cluster.kube.create(pod)
        ready = "False" if ordinal == 5 else "True"
        cluster.patch_status(
            "Pod", namespace, pod["metadata"]["name"], {"conditions": [{"type": "Ready", "status": ready}]}
        )
    make_ready(cluster, namespace, "smollm2", 1, 5, 1)
    wait_for(
        lambda: status(cluster, namespace, "smollm2").get("decode", {}).get("summary") == "2/3",
        what="decode 2/3 (a partial group serves nothing)",
    )
    cluster.patch_status("Pod", namespace, "smollm2-decode-5", {"conditions": [{"type": "Ready", "status": "True"}]})
    make_ready(cluster, namespace, "smollm2", 1, 6, 1)
    wait_for(lambda: status(cluster, namespace, "smollm2").get("decode", {}).get("summary") == "3/3", what="decode 3/3")
    out = cluster.kubectl(
        "get", "pdis/smollm2", "-n", namespace, "-o", "jsonpath={.status.decode.replicas} {.status.decode.selector}"
    ).stdout
    assert out.split() == ["3", selector_string("smollm2", "decode")]
    scale = cluster.kubectl(
        "get", "--raw", f"/apis/pdserve.dev/v1alpha1/namespaces/{namespace}/pdinferenceservices/smollm2/scale"
    ).stdout
    assert '"replicas":3' in scale.replace(" ", "")


def test_hand_edits_and_deletions_of_children_are_reverted(
    cluster: Cluster, operator: OperatorHandle, namespace: str, tmp_path: Path
) -> None:
    apply(cluster, namespace, yaml.safe_load(SAMPLE.read_text()), tmp_path)
    wait_for(lambda: all_children(cluster, namespace, "smollm2"), what="all children")
    wait_for(lambda: status(cluster, namespace, "smollm2").get("phase"), what="first status")

    cluster.kubectl("scale", "statefulset/smollm2-decode", "--replicas=5", "-n", namespace)
    cluster.kubectl("set", "env", "deployment/smollm2-prefill", "PDSERVE_QUEUE_DEPTH=99", "-n", namespace)
    wait_for(
        lambda: cluster.get("StatefulSet", namespace, "smollm2-decode")["spec"]["replicas"] == 1,
        what="replicas reverted",
    )
    wait_for(
        lambda: env_of(cluster.get("Deployment", namespace, "smollm2-prefill"))["PDSERVE_QUEUE_DEPTH"] == "8",
        what="env reverted",
    )

    cluster.kubectl("delete", "service/smollm2", "configmap/smollm2-config", "-n", namespace)
    wait_for(
        lambda: cluster.get("Service", namespace, "smollm2") and cluster.get("ConfigMap", namespace, "smollm2-config"),
        what="recreated",
    )
    events = cluster.kube.request("GET", f"/api/v1/namespaces/{namespace}/events")["items"]
    assert any(
        e.get("reason") == "DriftReverted" and "StatefulSet/smollm2-decode" in e.get("message", "") for e in events
    )


def test_invalid_resources_are_rejected_or_marked(
    cluster: Cluster, operator: OperatorHandle, namespace: str, tmp_path: Path
) -> None:
    bad = yaml.safe_load(SAMPLE.read_text())
    bad["metadata"]["name"] = "bad"
    bad["spec"]["decode"]["replicas"] = -1
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    out = cluster.kubectl("apply", "--validate=false", "-n", namespace, "-f", str(path), check=False)
    assert out.returncode != 0 and "spec.decode.replicas" in out.stderr, out.stderr

    cel = yaml.safe_load(SAMPLE.read_text())
    cel["metadata"]["name"] = "cel"
    cel["spec"]["device"] = {"type": "npu"}
    path.write_text(yaml.safe_dump(cel))
    out = cluster.kubectl("apply", "--validate=false", "-n", namespace, "-f", str(path), check=False)
    assert out.returncode != 0 and "spec.device.resourceName" in out.stderr and "required" in out.stderr, out.stderr

    # Passes the schema, fails what only the operator knows: 31 shards of a 30-layer model.
    deep = yaml.safe_load(SAMPLE.read_text())
    deep["metadata"]["name"] = "deep"
    deep["spec"]["decode"]["layerShards"] = 31
    apply(cluster, namespace, deep, tmp_path)
    st = wait_for(lambda: (s := status(cluster, namespace, "deep")).get("phase") == "Invalid" and s, what="Invalid")
    valid = next(c for c in st["conditions"] if c["type"] == "SpecValid")
    assert valid["status"] == "False" and "decode.layerShards" in valid["message"]
    assert cluster.get("StatefulSet", namespace, "deep-decode") is None

    # kopf posts the Event after the status patch: wait for it rather than race it.
    def invalid_event() -> bool:
        events = cluster.kube.request("GET", f"/api/v1/namespaces/{namespace}/events")["items"]
        return any(e.get("reason") == "InvalidSpec" and e.get("type") == "Warning" for e in events)

    wait_for(invalid_event, what="InvalidSpec warning event")

    cluster.kube.merge_patch(KINDS["PDInferenceService"], namespace, "deep", {"spec": {"decode": {"layerShards": 2}}})
    wait_for(lambda: cluster.get("StatefulSet", namespace, "deep-decode"), what="children after the fix")
    wait_for(lambda: status(cluster, namespace, "deep").get("phase") == "Pending", what="valid again")


def test_deleting_the_resource_removes_children_and_broker_entry(
    cluster: Cluster, operator: OperatorHandle, namespace: str, tmp_path: Path
) -> None:
    apply(cluster, namespace, yaml.safe_load(SAMPLE.read_text()), tmp_path)
    wait_for(lambda: all_children(cluster, namespace, "smollm2"), what="all children")
    assert f"{namespace}/smollm2" in operator.broker.tokens
    cluster.kubectl(
        "delete", "pdis/smollm2", "-n", namespace, "--wait=true", "--timeout=60s"
    )  # the operator's finalizer runs first: slow under load

    def left() -> list[str]:
        return [f"{kind}/{name}" for (kind, name), v in children_of(cluster, namespace, "smollm2").items() if v]

    try:  # (a reconcile that read the resource just before its deletion may create a child after it:
        # the garbage collector takes that too, as Kubernetes' does)
        wait_for(lambda: not left(), what="children gone")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; still there: {left()}") from None
    assert cluster.get("PDInferenceService", namespace, "smollm2") is None
    assert operator.broker.removed == [f"{namespace}/smollm2"] and f"{namespace}/smollm2" not in operator.broker.tokens


def test_restarting_the_operator_changes_nothing_that_was_right(
    cluster: Cluster, operator: OperatorHandle, namespace: str, tmp_path: Path
) -> None:
    apply(cluster, namespace, yaml.safe_load(SAMPLE.read_text()), tmp_path)
    wait_for(lambda: all_children(cluster, namespace, "smollm2"), what="all children")
    operator.broker.counts[f"{namespace}/smollm2"] = {"prefill": 1, "decode": 1, "router": 1}
    make_ready(cluster, namespace, "smollm2", 1, 1, 1)
    wait_for(lambda: status(cluster, namespace, "smollm2").get("phase") == "Ready", what="Ready")
    time.sleep(1.5)  # let the child events of make_ready settle

    def versions() -> dict[str, str]:
        out = {
            f"{k}/{n}": v["metadata"]["resourceVersion"]
            for (k, n), v in all_children(cluster, namespace, "smollm2").items()
        }
        cr = cluster.get("PDInferenceService", namespace, "smollm2")
        out["status"] = yaml.safe_dump(cr["status"])
        out["spec"] = yaml.safe_dump(cr["spec"])
        return out

    before = versions()
    operator.stop()
    calls = operator.broker.token_calls
    operator.start()
    wait_for(lambda: operator.broker.token_calls > calls, what="the restarted operator's first reconcile")
    time.sleep(2.5)  # several resync periods
    assert versions() == before


def adapter_of(cluster: Cluster, ns: str, name: str) -> dict[str, Any] | None:
    return cluster.kube.get(KINDS["PDScalingAdapter"], ns, name)


def synced_adapter(cluster: Cluster, ns: str, name: str, replicas: int) -> dict[str, Any] | bool:
    """The adapter once the operator took `replicas` from it (or gave it them)."""
    got = adapter_of(cluster, ns, name)
    if got is None or got["spec"]["replicas"] != replicas:
        return False
    return got if (got.get("status") or {}).get("observedGeneration") == got["metadata"]["generation"] else False


def test_kubectl_scale_of_a_role_adapter_drives_that_role(
    cluster: Cluster, operator: OperatorHandle, namespace: str, tmp_path: Path
) -> None:
    """Issue #34: prefill gets a scale target of its own (PDScalingAdapter), kept equal to the spec both ways."""
    doc = yaml.safe_load(SAMPLE.read_text())
    apply(cluster, namespace, doc, tmp_path)
    for role in ("prefill", "decode"):
        wait_for(lambda r=role: synced_adapter(cluster, namespace, f"smollm2-{r}", 1), what=f"{role} adapter")

    cluster.kubectl("scale", "pdsa/smollm2-prefill", "--replicas=3", "-n", namespace)
    wait_for(
        lambda: cluster.get("Deployment", namespace, "smollm2-prefill")["spec"]["replicas"] == 3, what="3 prefill pods"
    )
    spec = cluster.get("PDInferenceService", namespace, "smollm2")["spec"]
    assert spec["prefill"]["replicas"] == 3 and spec["decode"]["replicas"] == 1
    make_ready(cluster, namespace, "smollm2", 3, 1, 1)
    wait_for(lambda: (adapter_of(cluster, namespace, "smollm2-prefill").get("status") or {}).get("replicas") == 3)
    scale = cluster.kubectl(
        "get", "--raw", f"/apis/pdserve.dev/v1alpha1/namespaces/{namespace}/pdscalingadapters/smollm2-prefill/scale"
    ).stdout.replace(" ", "")
    assert '"replicas":3' in scale and selector_string("smollm2", "prefill") in scale, scale
    table = cluster.kubectl("get", "pdsa", "-n", namespace).stdout
    assert "smollm2-prefill" in table and "ROLE" in table, table

    # The other way: the service's own scale (decode groups) moves the decode adapter.
    cluster.kubectl("scale", "pdis/smollm2", "--replicas=2", "-n", namespace)
    wait_for(lambda: synced_adapter(cluster, namespace, "smollm2-decode", 2), what="decode adapter at 2")
    assert cluster.get("StatefulSet", namespace, "smollm2-decode")["spec"]["replicas"] == 2


def test_the_planner_takes_a_scaled_adapter_as_its_floor_and_refusals_are_events(
    cluster: Cluster, operator: OperatorHandle, namespace: str, tmp_path: Path
) -> None:
    doc = yaml.safe_load(SAMPLE.read_text())
    doc["spec"]["autoscaling"] = {
        "prefill": {"enabled": True, "minReplicas": 1, "maxReplicas": 4},
        "slo": {"ttftMs": 3000},
        "scaleUpWindowSeconds": 0,
        "scaleDownWindowSeconds": 0,
        "intervalSeconds": 1,
    }
    apply(cluster, namespace, doc, tmp_path)
    wait_for(lambda: synced_adapter(cluster, namespace, "smollm2-prefill", 1), what="prefill adapter")
    make_ready(cluster, namespace, "smollm2", 1, 1, 1)

    cluster.kubectl("scale", "pdsa/smollm2-prefill", "--replicas=3", "-n", namespace)
    wait_for(
        lambda: cluster.get("Deployment", namespace, "smollm2-prefill")["spec"]["replicas"] == 3,
        what="the planner up to its new floor",
    )
    wait_for(  # the planner's doing, and it says why
        lambda: (
            "moved to 3:1 by the bounds" in status(cluster, namespace, "smollm2")["autoscaling"]["prefill"]["reason"]
        ),
        what="the planner's reason",
    )

    # Above the planner's maxReplicas: the service refuses it, the adapter says what it has.
    cluster.kubectl("scale", "pdsa/smollm2-prefill", "--replicas=6", "-n", namespace)
    wait_for(lambda: synced_adapter(cluster, namespace, "smollm2-prefill", 3), what="adapter back at 3")
    events = cluster.kube.request("GET", f"/api/v1/namespaces/{namespace}/events")["items"]
    refused = [e["message"] for e in events if e.get("reason") == "ScaleRefused"]
    assert refused and "replicas 6 refused" in refused[0], refused
    assert cluster.get("PDInferenceService", namespace, "smollm2")["spec"]["prefill"]["replicas"] == 3


# Test-only stand-in for the Gateway API Inference Extension's InferencePool CRD: it makes the
# API exist, and checks nothing of the object (the upstream CRD file could not be fetched here,
# so no claim of upstream validity is made by this test; docs/gateway.md says so).
STAND_IN_POOL_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "inferencepools.inference.networking.k8s.io"},
    "spec": {
        "group": "inference.networking.k8s.io",
        "scope": "Namespaced",
        "names": {"kind": "InferencePool", "plural": "inferencepools", "singular": "inferencepool"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {"spec": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
                    }
                },
            }
        ],
    },
}


def test_an_inference_pool_waits_for_its_api_then_selects_the_routers(
    cluster: Cluster, operator: OperatorHandle, namespace: str, tmp_path: Path
) -> None:
    doc = yaml.safe_load(SAMPLE.read_text())
    doc["spec"]["router"]["endpointPickerPort"] = 9002
    doc["spec"]["router"]["inferencePool"] = {"enabled": True}
    pools = f"/apis/inference.networking.k8s.io/v1/namespaces/{namespace}/inferencepools"
    if cluster.kubectl("get", "crd", "inferencepools.inference.networking.k8s.io", check=False).returncode != 0:
        apply(cluster, namespace, doc, tmp_path)
        wait_for(
            lambda: "no inference.networking.k8s.io/v1 InferencePool API" in str(status(cluster, namespace, "smollm2")),
            what="Degraded, naming the missing API",
        )
        assert cluster.get("Service", namespace, "smollm2-epp") is not None  # everything else was applied
        assert status(cluster, namespace, "smollm2")["phase"] == "Degraded"
        cluster.kube.request("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", STAND_IN_POOL_CRD)
    else:
        apply(cluster, namespace, doc, tmp_path)
    pool = wait_for(lambda: cluster.kube.get(KINDS["InferencePool"], namespace, "smollm2"), what="the pool")
    assert pool["spec"]["selector"]["matchLabels"] == selector_labels("smollm2", "router")
    ref = pool["spec"]["endpointPickerRef"]
    assert {k: ref.get(k) for k in ("name", "port", "failureMode")} == {
        "name": "smollm2-epp",
        "port": {"number": 9002},
        "failureMode": "FailOpen",
    }
    # Where an earlier test installed the upstream CRD rather than the stand-in, its schema
    # defaults the reference's group and kind (a Service in the core group).
    assert (ref.get("group", ""), ref.get("kind", "Service")) == ("", "Service"), ref
    listed = cluster.kube.request("GET", pools)["items"]
    assert [p["metadata"]["name"] for p in listed] == ["smollm2"]
    operator.broker.counts[f"{namespace}/smollm2"] = {"prefill": 1, "decode": 1, "router": 1}
    make_ready(cluster, namespace, "smollm2", 1, 1, 1)
    wait_for(lambda: status(cluster, namespace, "smollm2").get("phase") == "Ready", what="Ready once the pool exists")
