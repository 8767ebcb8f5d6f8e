"""Decode groups as a LeaderWorkerSet (spec.decode.groupScheduling, issue #34 item 3), on the API
emulator with the real operator: refused with a clear condition while the cluster lacks the LWS
API; once it has it, one LeaderWorkerSet whose replicas are groups, whose pods find their place
and their group's members from the environment the operator renders; `kubectl scale` moves
groups; a switch back to a StatefulSet removes the LeaderWorkerSet.

The LWS CRD here is the upstream file as it ships (kubernetes-sigs/lws@060ab4da,
config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml; tests/support/leaderworkerset.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from conftest import ROOT, Cluster, OperatorHandle, wait_for
from pdserve_operator import spec as s
from pdserve_operator.handlers import TIMER_TICK_SECONDS
from pdserve_operator.kube import KINDS
from pdserve_operator.reconcile import decode_groups as dg
from pdserve_operator.reconcile.children.meta import secret_name, workload_name
from pdserve_operator.runtime import OperatorConfig
from support import leaderworkerset as lws
from support.worker_env import worker_settings

SAMPLE = ROOT / "manifests" / "samples" / "smollm2-cpu.yaml"
NAME = "gang"


def status(cluster: Cluster, ns: str) -> dict[str, Any]:
    return (cluster.get("PDInferenceService", ns, NAME) or {}).get("status") or {}


def apply(cluster: Cluster, ns: str, doc: dict[str, Any], tmp: Path) -> None:
    path = tmp / "gang.yaml"
    path.write_text(yaml.safe_dump(doc))
    cluster.kubectl("apply", "--validate=false", "-n", ns, "-f", str(path))


def ensure_lws_api(cluster: Cluster, ns: str, doc: dict[str, Any], tmp: Path) -> None:
    """Apply the service; when the cluster lacks the LWS API, first see the refusal, then install it."""
    installed = cluster.kubectl("get", "crd", lws.CRD["metadata"]["name"], check=False).returncode == 0
    apply(cluster, ns, doc, tmp)
    if installed:
        return
    wait_for(
        lambda: "no leaderworkerset.x-k8s.io/v1 LeaderWorkerSet API" in str(status(cluster, ns)),
        what="Degraded, naming the missing API",
    )
    st = status(cluster, ns)
    assert st["phase"] == "Degraded"
    assert "groupScheduling: statefulSet" in str(st["conditions"])  # says the way out too
    # No quiet fallback: the user asked for gang scheduling, a StatefulSet would not give it.
    assert cluster.get("StatefulSet", ns, workload_name(NAME, "decode")) is None
    cluster.kube.request("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", lws.CRD)
    cluster.kubectl("wait", "--for=condition=established", f"crd/{lws.CRD['metadata']['name']}", "--timeout=20s")


def create_pods(cluster: Cluster, ns: str, obj: dict[str, Any], groups: int, size: int) -> list[dict[str, Any]]:
    """Play LWS's controller: the groups' pods, named and labelled as it would, all Ready."""
    template = obj["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    made = []
    for g in range(groups):
        for w, pod_name in enumerate(lws.pod_names(obj["metadata"]["name"], g, size)):
            pod = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": pod_name, "labels": lws.pod_labels(obj, g, w)},
                "spec": template["spec"],
            }
            cluster.kube.request("POST", f"/api/v1/namespaces/{ns}/pods", pod)
            ready = {"conditions": [{"type": "Ready", "status": "True"}]}
            cluster.kube.merge_patch(KINDS["Pod"], ns, pod_name, {"status": ready}, "status")
            made.append(pod)
    return made


def test_decode_groups_run_as_one_leader_worker_set(
    cluster: Cluster, operator: OperatorHandle, namespace: str, tmp_path: Path
) -> None:
    doc = yaml.safe_load(SAMPLE.read_text())
    doc["metadata"]["name"] = NAME
    doc["spec"]["decode"].update({"replicas": 2, "layerShards": 2, "groupScheduling": "leaderWorkerSet"})
    ensure_lws_api(cluster, namespace, doc, tmp_path)
    name = workload_name(NAME, "decode")
    obj = wait_for(lambda: cluster.kube.get(KINDS["LeaderWorkerSet"], namespace, name), what="the LeaderWorkerSet")
    # Admitted by the CRD's schema (the emulator validates on create); replicas count groups.
    assert obj["spec"]["replicas"] == 2
    template = obj["spec"]["leaderWorkerTemplate"]
    assert (template["size"], template["restartPolicy"]) == (2, "RecreateGroupOnPodRestart")
    assert cluster.get("StatefulSet", namespace, name) is None

    # Every pod LWS would make finds its group and member, and its group's members by DNS.
    secret = cluster.get("Secret", namespace, secret_name(NAME))
    decode = dg.DecodeWorkload("LeaderWorkerSet", name, 2)
    places = {}
    for pod in create_pods(cluster, namespace, obj, groups=2, size=2):
        env = worker_settings(lws.pod_environ(pod, pod["metadata"]["name"], pod["metadata"]["labels"], secret))
        places[pod["metadata"]["name"]] = env.group_member
        group, _ = env.group_member
        assert env.peers == [f"{p}.{name}:50051" for p in lws.pod_names(name, group, 2)]
        assert decode.place(pod) == group * 2 + env.group_member[1]
    assert places == {f"{name}-0": (0, 0), f"{name}-0-1": (0, 1), f"{name}-1": (1, 0), f"{name}-1-1": (1, 1)}
    # The pod a group registers under is the one the operator drains on a scale-down.
    assert decode.leader_ids(range(2)) == (f"{name}-0", f"{name}-1")

    # Ready: LWS reports groups; the operator counts complete groups from the labelled pods.
    for role in ("prefill", "router"):
        dep = workload_name(NAME, role)
        gen = cluster.get("Deployment", namespace, dep)["metadata"]["generation"]
        cluster.patch_status(
            "Deployment",
            namespace,
            dep,
            {"observedGeneration": gen, "replicas": 1, "readyReplicas": 1, "updatedReplicas": 1},
        )
    cluster.patch_status("LeaderWorkerSet", namespace, name, {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2})
    operator.broker.counts[f"{namespace}/{NAME}"] = {"prefill": 1, "decode": 4, "router": 1}  # every member
    ready = wait_for(lambda: (st := status(cluster, namespace)).get("phase") == "Ready" and st, what="Ready")
    assert ready["decode"]["ready"] == 2 and ready["decode"]["replicas"] == 2
    assert ready["decode"]["workloadKind"] == "LeaderWorkerSet"

    # kubectl scale moves groups: the LeaderWorkerSet's replicas, never pods x shards.
    cluster.kubectl("scale", f"pdis/{NAME}", "--replicas=3", "-n", namespace)
    wait_for(lambda: cluster.kube.get(KINDS["LeaderWorkerSet"], namespace, name)["spec"]["replicas"] == 3, what="3")

    # Back to a StatefulSet: it is made first, then the LeaderWorkerSet goes, with an Event.
    cluster.kube.merge_patch(KINDS[s.KIND], namespace, NAME, {"spec": {"decode": {"groupScheduling": "statefulSet"}}})
    sts = wait_for(lambda: cluster.get("StatefulSet", namespace, name), what="the StatefulSet")
    assert sts["spec"]["replicas"] == 6  # 3 groups x 2 pods
    wait_for(lambda: cluster.kube.get(KINDS["LeaderWorkerSet"], namespace, name) is None, what="the LWS removed")

    def replaced() -> list[str]:  # (the Event is posted just after the delete: wait for it too)
        events = cluster.kube.request("GET", f"/api/v1/namespaces/{namespace}/events")["items"]
        return [e["message"] for e in events if e.get("reason") == "DecodeWorkloadReplaced"]

    wait_for(replaced, what="the DecodeWorkloadReplaced event")
    assert replaced() == [f"LeaderWorkerSet/{name} removed: the decode groups run as a StatefulSet now"]


@dataclass
class WatchingOperator(OperatorHandle):
    """The operator as the chart runs it with leaderWorkerSet.enabled (watching LWS objects), and
    a resync far beyond the test: whatever it does here, an event made it do."""

    def config(self) -> OperatorConfig:
        return super().config().model_copy(update={"watch_leader_worker_sets": True, "resync_seconds": 600.0})


def test_a_leader_worker_sets_status_reaches_the_service_at_once(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    """With the watch, the LWS controller's status update (its groups: what `kubectl scale` and
    an HPA read back as status.decode.replicas) reconciles the service at once; without it, and
    with no other event, it would wait for the resync (600 s here)."""
    doc = yaml.safe_load(SAMPLE.read_text())
    doc["metadata"]["name"] = NAME
    doc["spec"]["decode"].update({"replicas": 1, "layerShards": 2, "groupScheduling": "leaderWorkerSet"})
    if cluster.kubectl("get", "crd", lws.CRD["metadata"]["name"], check=False).returncode != 0:
        cluster.kube.request("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", lws.CRD)
        cluster.kubectl("wait", "--for=condition=established", f"crd/{lws.CRD['metadata']['name']}", "--timeout=20s")
    operator = WatchingOperator(cluster, namespace)
    operator.start()
    try:
        apply(cluster, namespace, doc, tmp_path)
        name = workload_name(NAME, "decode")
        obj = wait_for(lambda: cluster.kube.get(KINDS["LeaderWorkerSet"], namespace, name), what="the LeaderWorkerSet")
        create_pods(cluster, namespace, obj, groups=1, size=2)
        operator.broker.counts[f"{namespace}/{NAME}"] = {"prefill": 1, "decode": 2, "router": 1}
        for role in ("prefill", "router"):  # (their events reconcile: the pods are counted then)
            dep = workload_name(NAME, role)
            gen = cluster.get("Deployment", namespace, dep)["metadata"]["generation"]
            cluster.patch_status(
                "Deployment",
                namespace,
                dep,
                {"observedGeneration": gen, "replicas": 1, "readyReplicas": 1, "updatedReplicas": 1},
            )
        ready = wait_for(lambda: (st := status(cluster, namespace)).get("phase") == "Ready" and st, what="Ready")
        assert ready["decode"]["replicas"] == 0  # the LWS has reported no group yet
        time.sleep(2 * TIMER_TICK_SECONDS)  # past the timer's first run (a resync at once), then none for 600 s
        cluster.patch_status(
            "LeaderWorkerSet", namespace, name, {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}
        )
        seen = wait_for(lambda: status(cluster, namespace)["decode"]["replicas"] == 1, 10, "the LWS's groups in status")
        assert seen and status(cluster, namespace)["decode"]["workloadKind"] == "LeaderWorkerSet"
    finally:
        operator.stop()
