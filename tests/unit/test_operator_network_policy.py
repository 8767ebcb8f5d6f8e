"""The per-service NetworkPolicy child (on by default) and the decode pods' transfer port."""

from __future__ import annotations

from pdserve_common import pod_env
from pdserve_operator import spec as s
from pdserve_operator.reconcile import children, drift
from pdserve_operator.reconcile.children.meta import (
    LABEL_INSTANCE,
    OPERATOR_POD_LABELS,
    Defaults,
    Owner,
    selector_labels,
)
from pdserve_operator.reconcile.children.policy import network_policy as child_network_policy
from pdserve_operator.runtime import OperatorConfig, build_runtime

OWNER = Owner(name="svc", namespace="team", uid="uid-1")


def render(network_policy: bool) -> dict[tuple[str, str], dict]:
    defaults = Defaults(image="img:1", broker_address="b:1", network_policy=network_policy, operator_namespace="ops")
    return {(o["kind"], o["metadata"]["name"]): o for o in children.render(OWNER, s.parse_spec({}), "tok", defaults)}


def test_policy_is_on_unless_the_operator_is_told_otherwise() -> None:
    """Real HIXL does not authenticate transfer peers: the policy is the KV plane's fence."""
    assert Defaults(image="i", broker_address="b:1").network_policy is True
    assert OperatorConfig(kubeconfig="unused").network_policy is True


def test_policy_is_rendered_only_when_enabled_and_before_any_pod() -> None:
    assert not any(kind == "NetworkPolicy" for kind, _ in render(False))
    order = [kind for kind, _ in render(True)]
    assert order[0] == "NetworkPolicy"
    assert order.index("NetworkPolicy") < min(order.index("Deployment"), order.index("StatefulSet"))


def test_grpc_and_transfer_ports_only_from_the_service_and_the_operator() -> None:
    policy = render(True)[("NetworkPolicy", "svc-workers")]
    assert policy["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    spec = policy["spec"]
    assert spec["podSelector"]["matchLabels"] == selector_labels("svc")
    assert spec["policyTypes"] == ["Ingress"]
    private, public = spec["ingress"]
    assert {p["port"] for p in private["ports"]} == {pod_env.GRPC_PORT, pod_env.TRANSFER_PORT}
    same_service, operator = private["from"]
    assert same_service == {
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/instance": "svc"}}
    }
    assert operator["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "ops"}
    assert operator["podSelector"]["matchLabels"] == OPERATOR_POD_LABELS
    # The HTTP port (OpenAI API on routers, probes, metrics) stays reachable; nothing else is listed.
    assert public == {"ports": [{"port": pod_env.HTTP_PORT, "protocol": "TCP"}]}


def test_policy_of_another_service_does_not_admit_this_one() -> None:
    other = child_network_policy(Owner("other", "team", "uid-2"), Defaults(image="i", broker_address="b:1"))
    peers = other["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
    assert peers[LABEL_INSTANCE] == "other" and peers != selector_labels("svc")


def test_live_policy_with_defaulted_fields_is_not_drift() -> None:
    desired = render(True)[("NetworkPolicy", "svc-workers")]
    live = {**desired, "metadata": {**desired["metadata"], "uid": "x", "resourceVersion": "7"}}
    assert drift.content_drift(desired, live) == []
    edited = {**live, "spec": {**desired["spec"], "ingress": desired["spec"]["ingress"][1:]}}
    assert drift.content_drift(desired, edited) != []


def test_decode_pods_declare_the_transfer_port_and_others_do_not() -> None:
    kids = render(False)
    ports = {
        name: {p["name"]: p["containerPort"] for p in obj["spec"]["template"]["spec"]["containers"][0]["ports"]}
        for (kind, name), obj in kids.items()
        if kind in ("Deployment", "StatefulSet")
    }
    assert ports["svc-decode"] == {
        "http": pod_env.HTTP_PORT,
        "probe": pod_env.PROBE_PORT,
        "grpc": pod_env.GRPC_PORT,
        "transfer": pod_env.TRANSFER_PORT,
    }
    assert "transfer" not in ports["svc-prefill"] and "transfer" not in ports["svc-router"]


def test_no_rule_opens_the_probe_port_to_pods() -> None:
    """#58 A2: the kubelet's probes shared the serving port, which two addresses could fill.
    The probe port has no ingress rule: Kubernetes admits the node's (the kubelet's) traffic
    whatever the policy says, and no pod of this service or any other reaches it."""
    policy = render(True)[("NetworkPolicy", "svc-workers")]
    opened = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    assert pod_env.PROBE_PORT not in opened and pod_env.HTTP_PORT in opened


def test_operator_settings_reach_the_children_defaults() -> None:
    config = OperatorConfig(network_policy=True, pod_namespace="ops", kubeconfig="unused")

    class NoKube:
        def close(self) -> None: ...

    runtime = build_runtime(config, kube=NoKube())  # type: ignore[arg-type]
    assert runtime.reconciler.defaults.network_policy is True
    assert runtime.reconciler.defaults.operator_namespace == "ops"


def test_a_routers_endpoint_picker_port_is_open_like_its_api() -> None:
    """#34: the gateway dials the picker from its own namespace (docs/gateway.md)."""
    defaults = Defaults(image="img:1", broker_address="b:1", network_policy=True, operator_namespace="ops")
    objs = children.render(OWNER, s.parse_spec({"router": {"endpointPickerPort": 9002}}), "tok", defaults)
    policy = next(o for o in objs if o["kind"] == "NetworkPolicy")
    private, public = policy["spec"]["ingress"]
    assert public == {"ports": [{"port": pod_env.HTTP_PORT, "protocol": "TCP"}, {"port": 9002, "protocol": "TCP"}]}
    assert 9002 not in {p["port"] for p in private["ports"]}
