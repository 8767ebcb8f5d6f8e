"""spec.workload DisaggregatedSet on the API emulator with the real operator (issue #57 item 2):
refused by name while the cluster lacks the API; once the upstream CRD file is installed
(kubernetes-sigs/lws @ 060ab4da, config/crd/bases/disaggregatedset.x-k8s.io_disaggregatedsets.yaml,
tests/upstream_crds/), one DisaggregatedSet admitted by that schema; `kubectl scale` of the decode
adapter moves the decode role, and the roles' status (played here as the set's controller would
write it) reaches `kubectl get pdis`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from conftest import ROOT, Cluster, OperatorHandle, wait_for
from pdserve_operator.kube import KINDS
from pdserve_operator.reconcile.children.meta import adapter_name, workload_name
from support import upstream_crds

SAMPLE = ROOT / "manifests" / "samples" / "smollm2-cpu.yaml"
NAME = "pdset"
DS_API = "disaggregatedset.x-k8s.io/v1"


def status(cluster: Cluster, ns: str) -> dict[str, Any]:
    return (cluster.get("PDInferenceService", ns, NAME) or {}).get("status") or {}


def decode_role(cluster: Cluster, ns: str) -> dict[str, Any]:
    ds = cluster.kube.get(KINDS["DisaggregatedSet"], ns, NAME)
    assert ds is not None
    return next(r["spec"] for r in ds["spec"]["roles"] if r["name"] == "decode")


def test_a_disaggregated_set_is_refused_by_name_then_created_scaled_and_read_back(
    cluster: Cluster, operator: OperatorHandle, namespace: str, tmp_path: Path
) -> None:
    doc = yaml.safe_load(SAMPLE.read_text())
    doc["metadata"]["name"] = NAME
    doc["spec"].pop("router", None)  # no API keys Secret needed here
    doc["spec"].update(workload="DisaggregatedSet")
    doc["spec"]["decode"].update(replicas=1, layerShards=2)
    try:
        run(cluster, namespace, tmp_path, doc)
    finally:  # a service left behind would be reconciled by a later test's all-namespace operator
        cluster.kubectl("delete", f"pdis/{NAME}", "-n", namespace, "--wait=true", "--timeout=50s", check=False)


def run(cluster: Cluster, namespace: str, tmp_path: Path, doc: dict[str, Any]) -> None:
    crd_name = upstream_crds.crd_name(DS_API, "DisaggregatedSet")
    installed = cluster.kubectl("get", "crd", crd_name, check=False).returncode == 0
    path = tmp_path / "pdset.yaml"
    path.write_text(yaml.safe_dump(doc))
    cluster.kubectl("apply", "--validate=false", "-n", namespace, "-f", str(path))
    if not installed:
        wait_for(
            lambda: "no disaggregatedset.x-k8s.io/v1 DisaggregatedSet API" in str(status(cluster, namespace)),
            what="Degraded, naming the missing API",
        )
        st = status(cluster, namespace)
        assert st["phase"] == "Degraded" and "set spec.workload: Deployments" in str(st["conditions"])
        # No quiet fallback to the Deployments the user opted out of.
        assert cluster.get("Deployment", namespace, workload_name(NAME, "prefill")) is None
        assert cluster.get("StatefulSet", namespace, workload_name(NAME, "decode")) is None
        crd = upstream_crds.crd(DS_API, "DisaggregatedSet")
        cluster.kube.request("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
        cluster.kubectl("wait", "--for=condition=established", f"crd/{crd_name}", "--timeout=20s")

    ds = wait_for(lambda: cluster.kube.get(KINDS["DisaggregatedSet"], namespace, NAME), what="the DisaggregatedSet")
    assert [r["name"] for r in ds["spec"]["roles"]] == ["prefill", "decode"]
    assert decode_role(cluster, namespace)["leaderWorkerTemplate"]["size"] == 2
    assert ds["spec"]["slices"] == 1  # the upstream default, written by pdserve
    # (the same sync writes the router's Deployment after the set: under load it may come a moment later)
    wait_for(lambda: cluster.get("Deployment", namespace, workload_name(NAME, "router")), what="the router Deployment")

    cluster.kubectl("scale", f"pdsa/{adapter_name(NAME, 'decode')}", "--replicas=2", "-n", namespace)
    wait_for(lambda: decode_role(cluster, namespace)["replicas"] == 2, what="the decode role scaled")
    assert cluster.get("PDInferenceService", namespace, NAME)["spec"]["decode"]["replicas"] == 2

    counts = [
        {"name": "prefill", "replicas": 1, "readyReplicas": 1, "updatedReplicas": 1},
        {"name": "decode", "replicas": 2, "readyReplicas": 2, "updatedReplicas": 2},
    ]
    cluster.kube.merge_patch(KINDS["DisaggregatedSet"], namespace, NAME, {"status": {"roleStatuses": counts}}, "status")
    wait_for(lambda: status(cluster, namespace).get("decode", {}).get("ready") == 2, what="the status follows")
    st = status(cluster, namespace)
    assert st["decode"]["workloadKind"] == "DisaggregatedSet" and st["prefill"]["ready"] == 1
    shown = cluster.kubectl("get", "pdis", NAME, "-n", namespace, "-o", "jsonpath={.status.decode.summary}").stdout
    assert shown == "2/2", shown
