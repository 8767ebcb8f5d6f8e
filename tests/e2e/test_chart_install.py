"""The Helm chart against the API emulator: install its objects, run the operator as its
Deployment configures it, and check that its RBAC grants exactly what the operator uses.

The operator runs with the chart Deployment's own PDSERVE_OPERATOR_* variables and under the
chart's service account (a bearer token that the emulator logs with every request). The
emulator authorizes nothing, so after a scenario that walks every path that talks to the API
(peering, create, status, events, drift repair of every child kind, the pod listing of sharded
decode, autoscaling's HPA and scale writes, deletion through the finalizer), each logged request is checked against the rendered
RBAC, and each granted permission must have been used by some request (least privilege). The
"gateway" mode adds the InferencePool and its InferenceObjectives, the "disaggregated" mode a
switch to spec.workload DisaggregatedSet and back (their upstream CRD files installed,
support/upstream_crds.py), so their grants are held to the same rule.
"""

from __future__ import annotations

import os
import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml
from test_operator import SAMPLE, all_children, status

import chart_tools
from conftest import ROOT, Cluster, OperatorHandle, wait_for
from kube_emulator.rbac import Authorizer, RequestAttributes, ServiceAccount, request_attributes
from netutil import free_port
from pdserve_operator.kube import KINDS, KubeError
from pdserve_operator.reconcile.children.meta import (
    APP,
    LABEL_NAME,
    adapter_name,
    network_policy_name,
    selector_labels,
    workload_name,
)
from pdserve_operator.reconcile.children.meta import hpa_name as child_hpa_name
from pdserve_operator.runtime import OperatorConfig
from support import upstream_crds

CHART_NAMESPACE = "pdserve-system"
ACCOUNT = ServiceAccount(CHART_NAMESPACE, "pdserve-operator")
OPERATOR_TOKEN = "token-of-serviceaccount-pdserve-system-pdserve-operator"

# Granted although the scenario never makes the call, each with its reason.
UNUSED_GRANTS_ALLOWED = {
    (
        "pdserve.dev",
        "pdinferenceservices/finalizers",
        "update",
    ): "children's ownerReferences set blockOwnerDeletion, which the OwnerReferencesPermissionEnforcement "
    "admission plugin (OpenShift) allows only with this permission on the owner; the emulator runs no admission",
    ("authentication.k8s.io", "tokenreviews", "create"): "the broker reviews a worker pod's identity token when "
    "the pod registers (#58 A4); the scenario runs no worker pod against the operator's broker",
}


@dataclass
class ChartOperator(OperatorHandle):
    """The e2e operator fixture, configured by the chart's Deployment instead of by hand."""

    deployment: dict[str, Any] = field(default_factory=dict)
    health_port: int = field(default_factory=free_port)

    def config(self) -> OperatorConfig:
        container = self.deployment["spec"]["template"]["spec"]["containers"][0]
        assert container["command"] == ["pdserve", "operator"], container["command"]
        env = {e["name"]: str(e["value"]) for e in container["env"] if "value" in e}
        with mock.patch.dict(os.environ, env):  # parsed exactly as in the pod (pydantic-settings)
            config = OperatorConfig()
        assert config.liveness is not None and config.liveness.endswith(f":{self.deployment_health_port()}/healthz")
        # What differs outside a pod: where the API is, and a loopback port for the liveness probe.
        return config.model_copy(
            update={
                "kubeconfig": str(self.cluster.kubeconfig),
                "liveness": f"http://127.0.0.1:{self.health_port}/healthz",
                "resync_seconds": 1.0,
            }
        )

    def deployment_health_port(self) -> int:
        container = self.deployment["spec"]["template"]["spec"]["containers"][0]
        return next(p["containerPort"] for p in container["ports"] if p["name"] == "health")


def probe(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return int(resp.status)
    except OSError:
        return None


def apply_chart(cluster: Cluster, objects: list[dict[str, Any]]) -> None:
    """`helm template | kubectl apply -f -`, the chart's crds/ first (as `helm install` does)."""
    cluster.kubectl("apply", "--validate=false", "-f", str(chart_tools.CHART / "crds"))
    out = cluster.kubectl("apply", "--validate=false", "-f", "-", stdin=yaml.safe_dump_all(objects))
    assert out.stdout.count("\n") == len(objects), out.stdout
    live = cluster.kubectl("get", "-f", "-", "-o", "name", stdin=yaml.safe_dump_all(objects)).stdout.split()
    assert len(live) == len(objects), live


@pytest.fixture(scope="module")
def chart_namespace(cluster: Cluster) -> Iterator[str]:
    try:
        cluster.kube.request(
            "POST",
            "/api/v1/namespaces",
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": CHART_NAMESPACE}},
        )
    except KubeError as exc:
        if exc.status != 409:
            raise
    yield CHART_NAMESPACE


def audit_mark(cluster: Cluster) -> int:
    return int(cluster.emulator.call(lambda emu: len(emu.audit_log)))


def operator_requests(cluster: Cluster, since: int) -> list[RequestAttributes]:
    entries = cluster.emulator.call(lambda emu: list(emu.audit_log[since:]))
    return [request_attributes(e.method, e.path, e.query) for e in entries if e.user == OPERATOR_TOKEN]


GATEWAY_KINDS = (("inference.networking.k8s.io/v1", "InferencePool"), ("llm-d.ai/v1alpha2", "InferenceObjective"))
OBJECTIVES = [{"name": "interactive", "priority": 10}]


def install_crds(cluster: Cluster, kinds: tuple[tuple[str, str], ...]) -> None:
    """The upstream CRD files of these kinds (GATEWAY_KINDS: the pool and the objective in the
    chart's default group)."""
    for api_version, kind in kinds:
        try:
            cluster.kube.request(
                "POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", upstream_crds.crd(api_version, kind)
            )
        except KubeError as exc:
            if exc.status != 409:
                raise


def run_scenario(
    cluster: Cluster, namespace: str, tmp_path: Path, network_policy: bool, broker: Any, mode: str
) -> None:
    """Everything the operator does to the API, once: see the module docstring."""
    doc = yaml.safe_load(SAMPLE.read_text())
    doc["spec"]["decode"]["layerShards"] = 2  # makes the reconciler list decode pods
    gateway = mode == "gateway"
    if gateway:
        pool = {"enabled": True, "objectives": OBJECTIVES}
        doc["spec"]["router"] = {**doc["spec"].get("router", {}), "endpointPickerPort": 9002, "inferencePool": pool}
    path = tmp_path / "sample.yaml"
    path.write_text(yaml.safe_dump(doc))
    cluster.kubectl("apply", "--validate=false", "-n", namespace, "-f", str(path))
    name = doc["metadata"]["name"]
    children = wait_for(lambda: all_children(cluster, namespace, name), what="all children")
    wait_for(lambda: status(cluster, namespace, name).get("phase") == "Pending", what="status Pending")
    kids = [(kind, cname) for kind, cname in children]
    if network_policy:
        policy = wait_for(
            lambda: cluster.get("NetworkPolicy", namespace, network_policy_name(name)), what="NetworkPolicy"
        )
        assert policy["spec"]["podSelector"]["matchLabels"] == selector_labels(name)
        kids.append(("NetworkPolicy", network_policy_name(name)))
    if gateway:
        gateway_kids = [("Service", f"{name}-epp"), ("InferencePool", name)]
        gateway_kids += [("InferenceObjective", f"{name}-{o['name']}") for o in OBJECTIVES]
        for kind, cname in gateway_kids:
            wait_for(lambda k=kind, n=cname: cluster.get(k, namespace, n), what=f"{kind}/{cname}")
        kids += gateway_kids

    # Hand edits of every child kind: each one is patched back.
    for kind, cname in kids:
        cluster.kube.merge_patch(KINDS[kind], namespace, cname, {"metadata": {"labels": {LABEL_NAME: "edited"}}})
    for kind, cname in kids:
        wait_for(
            lambda k=kind, n=cname: cluster.get(k, namespace, n)["metadata"]["labels"][LABEL_NAME] == APP,
            what=f"{kind}/{cname} repaired",
        )

    adapter_scenario(cluster, namespace, name)
    autoscaling_scenario(cluster, broker, namespace, name)
    if mode == "disaggregated":
        disaggregated_scenario(cluster, namespace, name)
    cluster.kubectl(
        "delete", f"pdis/{name}", "-n", namespace, "--wait=true", "--timeout=60s"
    )  # the operator's finalizer runs first: slow under load
    assert cluster.get("PDInferenceService", namespace, name) is None


def disaggregated_scenario(cluster: Cluster, namespace: str, name: str) -> None:
    """spec.workload DisaggregatedSet and back: the set replaces the prefill Deployment and the
    decode StatefulSet (the router stays), is repaired when edited, follows `kubectl scale` of the
    decode adapter, its roles' status reaches the service, and a switch back removes it."""
    pdis, ds_kind = KINDS["PDInferenceService"], KINDS["DisaggregatedSet"]
    router_uid = cluster.get("Deployment", namespace, workload_name(name, "router"))["metadata"]["uid"]
    switch = {
        "autoscaling": None,
        "workload": "DisaggregatedSet",
        "decode": {"replicas": 1},
        "prefill": {"replicas": 1},
    }
    cluster.kube.merge_patch(pdis, namespace, name, {"spec": switch})
    wait_for(lambda: cluster.kube.get(ds_kind, namespace, name), what="the DisaggregatedSet")
    for kind, role in (("Deployment", "prefill"), ("StatefulSet", "decode")):
        wait_for(lambda k=kind, r=role: cluster.get(k, namespace, workload_name(name, r)) is None, what=f"{kind} gone")
    assert cluster.get("Deployment", namespace, workload_name(name, "router"))["metadata"]["uid"] == router_uid
    cluster.kube.merge_patch(ds_kind, namespace, name, {"metadata": {"labels": {LABEL_NAME: "edited"}}})
    wait_for(
        lambda: cluster.kube.get(ds_kind, namespace, name)["metadata"]["labels"][LABEL_NAME] == APP, what="repaired"
    )
    cluster.kubectl("scale", f"pdsa/{adapter_name(name, 'decode')}", "--replicas=3", "-n", namespace)

    def decode_role() -> dict[str, Any]:
        return next(r for r in cluster.kube.get(ds_kind, namespace, name)["spec"]["roles"] if r["name"] == "decode")

    wait_for(lambda: decode_role()["spec"]["replicas"] == 3, what="the decode role scaled")
    counts = [
        {"name": "prefill", "replicas": 1, "readyReplicas": 1, "updatedReplicas": 1},
        {"name": "decode", "replicas": 3, "readyReplicas": 3, "updatedReplicas": 3},
    ]
    cluster.kube.merge_patch(ds_kind, namespace, name, {"status": {"roleStatuses": counts}}, "status")
    wait_for(lambda: status(cluster, namespace, name)["decode"]["ready"] == 3, what="the status follows")
    cluster.kube.merge_patch(pdis, namespace, name, {"spec": {"workload": "Deployments"}})
    wait_for(lambda: cluster.kube.get(ds_kind, namespace, name) is None, what="the DisaggregatedSet removed")


def adapter_scenario(cluster: Cluster, namespace: str, name: str) -> None:
    """The per-role PDScalingAdapter's calls: a scaled adapter moves the spec, a moved spec the adapter."""
    pdis, adapter = KINDS["PDInferenceService"], KINDS["PDScalingAdapter"]
    prefill = adapter_name(name, "prefill")
    wait_for(lambda: (cluster.kube.get(adapter, namespace, prefill) or {}).get("status"), what="adapter synced")
    cluster.kubectl("scale", f"pdsa/{prefill}", "--replicas=2", "-n", namespace)
    wait_for(lambda: cluster.get("PDInferenceService", namespace, name)["spec"]["prefill"]["replicas"] == 2)
    cluster.kube.merge_patch(pdis, namespace, name, {"spec": {"prefill": {"replicas": 1}}})
    wait_for(lambda: cluster.kube.get(adapter, namespace, prefill)["spec"]["replicas"] == 1, what="adapter follows")


def autoscaling_scenario(cluster: Cluster, broker: Any, namespace: str, name: str) -> None:
    """Autoscaling's calls: an HPA rendered, repaired and removed; the planner writing both
    workloads' replicas through their scale subresources (a busy decode in the broker)."""
    from pdserve_common.kv_layout import KVLayout
    from pdserve_common.membership import Load, Member, MemberInfo, MemoryRegion, Role

    layout = KVLayout(num_slots=8, num_layers=2, max_len=16, kv_heads=1, head_dim=8, dtype="float32")
    busy = Member(
        MemberInfo(
            worker_id=f"{name}-decode-0",
            role=Role.DECODE,
            grpc_endpoint="10.0.0.1:7000",
            engine_id="10.0.0.1:7100",
            regions=(MemoryRegion(0x10000, layout.total_bytes),),
            kv_layout=layout,
            revision="r",
            slots_total=8,
            slots_free=0,
        ),
        load=Load(slots_used=8, slots_free=0, active_requests=8),
    )
    broker.loads[f"{namespace}/{name}"] = [busy]
    hpa_metric = {"type": "Resource", "name": "cpu", "target": {"type": "Utilization", "averageUtilization": 70}}
    autoscaling = {
        "slo": {"ttftMs": 2000, "tpotMs": 100},
        "intervalSeconds": 1,
        "scaleUpWindowSeconds": 0,
        "prefill": {"enabled": True, "driver": "hpa", "maxReplicas": 4, "metric": hpa_metric},
        "decode": {"enabled": True, "maxReplicas": 3},
    }
    pdis = KINDS["PDInferenceService"]
    cluster.kube.merge_patch(pdis, namespace, name, {"spec": {"autoscaling": autoscaling}})
    hpa_kind = KINDS["HorizontalPodAutoscaler"]
    hpa_name = child_hpa_name(name, "prefill")
    wait_for(lambda: cluster.kube.get(hpa_kind, namespace, hpa_name), what="the prefill HPA")
    sts = workload_name(name, "decode")
    wait_for(lambda: cluster.get("StatefulSet", namespace, sts)["spec"]["replicas"] > 2, what="decode scaled up")
    cluster.kube.merge_patch(hpa_kind, namespace, hpa_name, {"spec": {"maxReplicas": 40}})
    wait_for(lambda: cluster.kube.get(hpa_kind, namespace, hpa_name)["spec"]["maxReplicas"] == 4, what="HPA repaired")
    autoscaling["prefill"] = {"driver": "planner", "metric": None}
    cluster.kube.merge_patch(pdis, namespace, name, {"spec": {"autoscaling": autoscaling}})
    wait_for(lambda: cluster.kube.get(hpa_kind, namespace, hpa_name) is None, what="the HPA removed")
    dep = workload_name(name, "prefill")
    wait_for(lambda: cluster.get("Deployment", namespace, dep)["spec"]["replicas"] > 1, what="prefill scaled up")


MODES = {
    # All namespaces (ClusterRole), defaults otherwise: the NetworkPolicy is on, and managed.
    "cluster-wide": lambda ns: [],
    # One namespace (Role there, a thin ClusterRole), with the NetworkPolicy turned off.
    "one-namespace": lambda ns: ["--set", f"watchNamespaces={{{ns}}}", "--set", "networkPolicy.enabled=false"],
    # All namespaces, with the gateway's kinds granted (and used: the sample asks for them).
    "gateway": lambda ns: ["--set", "inferencePool.enabled=true"],
    # All namespaces, with the DisaggregatedSet granted (and used: the scenario switches to it and back).
    "disaggregated": lambda ns: ["--set", "disaggregatedSet.enabled=true"],
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_chart_installs_runs_the_operator_and_grants_exactly_what_it_uses(
    cluster: Cluster, chart_namespace: str, namespace: str, tmp_path: Path, mode: str
) -> None:
    objects = chart_tools.render(*MODES[mode](namespace))
    apply_chart(cluster, objects)
    if mode == "gateway":
        install_crds(cluster, GATEWAY_KINDS)
    if mode == "disaggregated":
        install_crds(cluster, (("disaggregatedset.x-k8s.io/v1", "DisaggregatedSet"),))
    deployment = chart_tools.by_kind(objects, "Deployment")[0]
    account = chart_tools.by_kind(objects, "ServiceAccount")[0]["metadata"]
    assert (account["namespace"], account["name"]) == (ACCOUNT.namespace, ACCOUNT.name)
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == ACCOUNT.name

    as_operator = replace(
        cluster, kubeconfig=cluster.emulator.write_kubeconfig(tmp_path / "operator-kubeconfig", token=OPERATOR_TOKEN)
    )
    handle = ChartOperator(as_operator, namespace, deployment=deployment)
    network_policy = handle.config().network_policy
    assert network_policy == (mode != "one-namespace")
    mark = audit_mark(cluster)
    handle.start()
    try:
        # The chart's liveness probe path is what the operator serves (kopf starts it just after ready).
        wait_for(lambda: probe(f"http://127.0.0.1:{handle.health_port}/healthz") == 200, what="liveness endpoint")
        run_scenario(cluster, namespace, tmp_path, network_policy, handle.broker, mode)
    finally:
        handle.stop()
    # Its own namespace's calls and the cluster-wide ones: a cluster-wide operator also
    # reconciles what other test modules left in this session's cluster (their own scenarios).
    requests = [r for r in operator_requests(cluster, mark) if r.namespace in ("", namespace, chart_namespace)]
    assert len(requests) > 20, requests

    authorizer = Authorizer(objects)
    denied = sorted({str(r) for r in requests if not authorizer.allowed(ACCOUNT, r)})
    assert not denied, "the chart's RBAC refuses calls the operator makes:\n" + "\n".join(denied)

    def used(ns: str, group: str, resource: str, verb: str) -> bool:
        return any(
            r.is_resource
            and (r.verb, r.group, r.resource_key) == (verb, group, resource)
            and (not ns or r.namespace == ns)
            for r in requests
        )

    grants = {g for rule in authorizer.rules_for(ACCOUNT) for g in rule.grants()}
    unused = sorted(g for g in grants if not used(*g) and g[1:] not in UNUSED_GRANTS_ALLOWED)
    assert not unused, f"granted but never used (least privilege): {unused}"
    assert any(g[1:] in UNUSED_GRANTS_ALLOWED for g in grants), "an allowed exception is no longer granted: drop it"


def test_helm_install_dry_run_prints_the_next_steps(cluster: Cluster, tmp_path: Path) -> None:
    """NOTES.txt renders only at install time; a client-side dry run against the emulator shows it."""
    env = dict(
        os.environ,
        KUBECONFIG=str(cluster.kubeconfig),
        HELM_CACHE_HOME=str(tmp_path / "cache"),
        HELM_CONFIG_HOME=str(tmp_path / "config"),
        HELM_DATA_HOME=str(tmp_path / "data"),
    )
    # A release of its own (helm refuses to adopt the objects the other tests applied with kubectl).
    out = subprocess.run(
        [
            chart_tools.helm(),
            "install",
            "notes",
            str(chart_tools.CHART),
            "-n",
            "notes-ns",
            "--set",
            "peering.name=notes",
            "--dry-run=client",
            "--disable-openapi-validation",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    notes = out.stdout.split("NOTES:", 1)[1]
    for step in (
        "kubectl -n notes-ns rollout status deployment/notes-pdserve-operator",
        "kubectl apply",
        "kubectl get pdis",
        "kubectl scale pdis/smollm2",
        "/v1/completions",
    ):
        assert step in notes, notes
    assert str(ROOT) not in notes
