"""spec.router.inferencePool: the InferencePool of the routers and its picker Service (issue #34).

What is checked here is that the three objects point at each other the way the gateway follows
them — pool selector → the router pods, pool targetPort → the routers' HTTP port, pool
endpointPickerRef → the picker Service → the port the routers' picker listens on — and what the
operator does on a cluster that lacks the InferencePool API or the permission to write one.
"""

from __future__ import annotations

import pytest

from pdserve_common import pod_env as E
from pdserve_operator import spec as s
from pdserve_operator.kube import PDIS, KubeError, kind_of
from pdserve_operator.reconcile.children import render
from pdserve_operator.reconcile.children.meta import Defaults, Owner
from support.kube_fake import DEFAULTS, fake_kube, reconcile, reconciler, service

NS = "team"
POOL = {"router": {"endpointPickerPort": 9002, "inferencePool": {"enabled": True}}}


def rendered(spec: dict) -> dict[tuple[str, str], dict]:
    owner = Owner("chat", NS, "u-1")
    return {(o["kind"], o["metadata"]["name"]): o for o in render(owner, s.parse_spec(spec), "t", DEFAULTS)}


def test_the_pool_selects_the_routers_and_names_their_picker() -> None:
    kids = rendered(POOL)
    pool, epp = kids[("InferencePool", "chat")], kids[("Service", "chat-epp")]
    router = kids[("Deployment", "chat-router")]
    pod_labels = router["spec"]["template"]["metadata"]["labels"]
    selector = pool["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod_labels.items()
    for other in ("prefill", "decode"):  # and nothing else of the service
        kind = "Deployment" if other == "prefill" else "StatefulSet"
        assert not selector.items() <= kids[(kind, f"chat-{other}")]["spec"]["template"]["metadata"]["labels"].items()
    container = router["spec"]["template"]["spec"]["containers"][0]
    http = next(p["containerPort"] for p in container["ports"] if p["name"] == "http")
    assert pool["spec"]["targetPorts"] == [{"number": http}]
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["name"] == epp["metadata"]["name"] and ref["failureMode"] == "FailOpen"
    (port,) = epp["spec"]["ports"]
    assert ref["port"]["number"] == port["port"] == 9002
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env[E.EPP_PORT_ENV] == str(port["targetPort"])  # the Service reaches the port the picker listens on
    assert epp["spec"]["selector"] == selector and epp["spec"]["type"] == "ClusterIP"
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["metadata"]["ownerReferences"][0]["uid"] == "u-1"


def test_off_by_default_and_refused_without_a_picker_port() -> None:
    assert not [k for k in rendered({"router": {"endpointPickerPort": 9002}}) if k[0] == "InferencePool"]
    with pytest.raises(s.ValidationError, match="inferencePool.enabled needs endpointPickerPort"):
        s.parse_spec({"router": {"inferencePool": {"enabled": True}}})
    closed = rendered({"router": {**POOL["router"], "inferencePool": {"enabled": True, "failureMode": "FailClose"}}})
    assert closed[("InferencePool", "chat")]["spec"]["endpointPickerRef"]["failureMode"] == "FailClose"


@pytest.mark.parametrize(
    ("status", "says"),
    [(404, "install the Gateway API Inference Extension's CRDs"), (403, "chart value inferencePool.enabled=true")],
)
def test_a_cluster_without_the_api_or_the_grant_serves_on_degraded_and_says_why(status: int, says: str) -> None:
    kube = fake_kube()
    kube.inner.create(service("chat", NS, POOL))
    kube.on("create", "InferencePool", error=KubeError(status, "x", "refused", "POST", "/apis/..."), times=-1)
    out = reconcile(reconciler(kube), NS, "chat")
    assert out is not None and "Deployment/chat-router" in out.created and "Service/chat-epp" in out.created
    assert out.created[-1].startswith("PodDisruptionBudget")  # the children after the pool were still applied
    status_now = kube.inner.get(PDIS, NS, "chat")["status"]
    degraded = next(c for c in status_now["conditions"] if c["type"] == "Degraded")
    assert status_now["phase"] == "Degraded" and degraded["status"] == "True"
    assert "InferencePool/chat" in degraded["message"] and says in degraded["message"], degraded


OBJECTIVES = {
    "router": {
        "endpointPickerPort": 9002,
        "inferencePool": {"enabled": True, "objectives": [{"name": "chat", "priority": 5}, {"name": "batch"}]},
    }
}


def test_objectives_name_the_pool_in_the_group_the_operator_is_set_to() -> None:
    kids = rendered(OBJECTIVES)
    objective = kids[("InferenceObjective", "chat-chat")]
    assert objective["apiVersion"] == "llm-d.ai/v1alpha2"  # the default: llm-d-router's group
    assert objective["spec"] == {
        "poolRef": {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "chat"},
        "priority": 5,
    }
    assert kids[("InferenceObjective", "chat-batch")]["spec"]["priority"] == 0
    assert kids[("InferencePool", "chat")]["metadata"]["name"] == objective["spec"]["poolRef"]["name"]
    older = Defaults(image="i", broker_address="b:1", objective_api_version="inference.networking.x-k8s.io/v1alpha2")
    owner = Owner("chat", NS, "u-1")
    again = [o for o in render(owner, s.parse_spec(OBJECTIVES), "t", older) if o["kind"] == "InferenceObjective"]
    assert {o["apiVersion"] for o in again} == {"inference.networking.x-k8s.io/v1alpha2"}
    assert (
        kind_of(again[0]).path(NS)
        == f"/apis/inference.networking.x-k8s.io/v1alpha2/namespaces/{NS}/inferenceobjectives"
    )
    with pytest.raises(s.ValidationError, match="objectives: each name once"):
        s.parse_spec(
            {"router": {**POOL["router"], "inferencePool": {"enabled": True, "objectives": [{"name": "a"}] * 2}}}
        )
    with pytest.raises(s.ValidationError, match="objectives need enabled"):
        s.parse_spec({"router": {"endpointPickerPort": 9002, "inferencePool": {"objectives": [{"name": "a"}]}}})


def test_a_cluster_without_the_objective_api_serves_on_degraded_and_names_the_chart_value() -> None:
    kube = fake_kube()
    kube.inner.create(service("chat", NS, OBJECTIVES))
    kube.on("create", "InferenceObjective", error=KubeError(404, "x", "not found", "POST", "/apis/..."), times=-1)
    out = reconcile(reconciler(kube), NS, "chat")
    assert out is not None and "InferencePool/chat" in out.created
    degraded = next(c for c in kube.inner.get(PDIS, NS, "chat")["status"]["conditions"] if c["type"] == "Degraded")
    assert "InferenceObjective/chat-chat" in degraded["message"] and "llm-d.ai/v1alpha2" in degraded["message"]
    assert "inferencePool.objectiveApiVersion" in degraded["message"], degraded
