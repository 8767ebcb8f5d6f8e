"""spec.decode.groupScheduling (issue #34 item 3): decode groups as a StatefulSet (default) or a
LeaderWorkerSet, and the one place (`decode_groups.py`) that says how either's counts and pods map
onto groups. The e2e twin (tests/e2e/test_leader_worker_set.py) runs it against the emulator."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from kube_emulator.schema import admit
from pdserve_operator import spec as s
from pdserve_operator.kube import PDIS, KubeError
from pdserve_operator.reconcile import decode_groups as dg
from pdserve_operator.reconcile import status as st
from pdserve_operator.reconcile.children import render
from pdserve_operator.reconcile.children.meta import LWS_API_VERSION, Owner, secret_name, selector_labels
from pdserve_operator.reconcile.children.meta import labels as child_labels
from pdserve_operator.reconcile.children.workloads import autoscaled_workloads
from support import leaderworkerset as lws
from support.kube_fake import DEFAULTS, fake_kube, reconcile, reconciler, service
from support.worker_env import worker_settings

NS = "team"
LWS = {"decode": {"replicas": 3, "layerShards": 4, "groupScheduling": "leaderWorkerSet"}}


def rendered(spec: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    owner = Owner("chat", NS, "u-1")
    return {(o["kind"], o["metadata"]["name"]): o for o in render(owner, s.parse_spec(spec), "t", DEFAULTS)}


@pytest.mark.parametrize(
    ("kind", "per", "leaders"),
    [
        ("StatefulSet", 4, ("chat-decode-8", "chat-decode-12")),
        ("LeaderWorkerSet", 1, ("chat-decode-2", "chat-decode-3")),
    ],
)
def test_counts_and_leaders_of_either_kind(kind: str, per: int, leaders: tuple[str, ...]) -> None:
    d = dg.DecodeWorkload(kind, "chat-decode", 4)
    assert d.per_replica == per
    assert d.replicas(3) == 3 * per and d.groups(d.replicas(3)) == 3
    assert d.leader_ids(range(2, 4)) == leaders


def test_a_pod_is_placed_by_ordinal_or_by_lws_labels() -> None:
    sts = dg.DecodeWorkload("StatefulSet", "chat-decode", 4)
    assert sts.place({"metadata": {"name": "chat-decode-9"}}) == 9
    group = dg.DecodeWorkload("LeaderWorkerSet", "chat-decode", 4)
    # LWS's worker pod chat-decode-2-3: its name's last number is not an ordinal; its labels are.
    pod = {"metadata": {"name": "chat-decode-2-3", "labels": {lws.GROUP_INDEX: "2", lws.WORKER_INDEX: "3"}}}
    assert group.place(pod) == 11
    # During a switch of groupScheduling both kinds' pods match the selector: each counts its own.
    old_sts_pod = {"metadata": {"name": "chat-decode-9", "labels": {}}}
    assert group.runs(pod) and not group.runs(old_sts_pod)
    assert sts.runs(old_sts_pod) and not sts.runs(pod)
    with pytest.raises(ValueError, match="'chat-decode-2-3' lacks the LeaderWorkerSet index labels"):
        group.place({"metadata": {"name": "chat-decode-2-3", "labels": {lws.GROUP_INDEX: "2"}}})


def test_the_default_stays_a_statefulset() -> None:
    kids = rendered({"decode": {"replicas": 3, "layerShards": 4}})
    assert kids[("StatefulSet", "chat-decode")]["spec"]["replicas"] == 12
    assert not any(kind == "LeaderWorkerSet" for kind, _ in kids)
    env = kids[("StatefulSet", "chat-decode")]["spec"]["template"]["spec"]["containers"][0]["env"]
    assert not {e["name"] for e in env} & {"PDSERVE_GROUP_INDEX", "PDSERVE_SHARD_INDEX", "PDSERVE_GROUP_PEERS"}


def test_the_leader_worker_set_is_one_unit_per_group_and_passes_the_schema() -> None:
    kids = rendered(LWS)
    assert ("StatefulSet", "chat-decode") not in kids
    obj = kids[("LeaderWorkerSet", "chat-decode")]
    assert obj["apiVersion"] == lws.GROUP + "/v1"
    spec = obj["spec"]
    assert spec["replicas"] == 3  # groups, not pods
    assert spec["leaderWorkerTemplate"]["size"] == 4
    assert spec["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"  # a group restarts as one
    template = spec["leaderWorkerTemplate"]["workerTemplate"]
    assert selector_labels("chat", "decode").items() <= template["metadata"]["labels"].items()
    schema = lws.CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    _, errors = admit(copy.deepcopy(obj), schema)
    assert errors == []
    # The upstream schema refuses what its markers refuse (so the pass above means something); a
    # size of 0 is LWS's webhook's to refuse, not the schema's (support/leaderworkerset.py).
    for path, bad, says in (
        (("replicas",), -1, "should be greater than or equal to 0"),
        (("leaderWorkerTemplate", "restartPolicy"), "Always", "Unsupported value"),
        (("startupPolicy",), "LeaderFirst", "Unsupported value"),
    ):
        broken = copy.deepcopy(obj)
        node = broken["spec"]
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = bad
        _, errors = admit(broken, schema)
        assert any(says in str(e) for e in errors), (path, errors)


def test_every_lws_pod_finds_its_group_and_members_from_the_rendered_env() -> None:
    kids = rendered(LWS)
    obj = kids[("LeaderWorkerSet", "chat-decode")]
    template = obj["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    secret = kids[("Secret", secret_name("chat"))]
    seen = {}
    for group in range(3):
        names = lws.pod_names("chat-decode", group, 4)
        for worker, pod in enumerate(names):
            env = worker_settings(lws.pod_environ(template, pod, lws.pod_labels(obj, group, worker), secret))
            seen[pod] = env.group_member
            # LWS's pods resolve under its headless Service, named like the LeaderWorkerSet.
            assert env.peers == [f"{n}.chat-decode:50051" for n in names]
    assert seen["chat-decode-2"] == (2, 0) and seen["chat-decode-2-3"] == (2, 3)
    assert sorted(seen.values()) == [(g, m) for g in range(3) for m in range(4)]


def test_a_group_index_without_a_member_is_refused() -> None:
    env = {
        "PDSERVE_ROLE": "decode",
        "PDSERVE_LAYER_SHARDS": "2",
        "PDSERVE_GROUP_INDEX": "1",
        "PDSERVE_POD_NAME": "x-0",
        "PDSERVE_BROKER_ADDRESS": "127.0.0.1:1",
        "PDSERVE_BROKER_TOKEN": "t",
    }
    with pytest.raises(ValueError, match="PDSERVE_GROUP_INDEX=1 without PDSERVE_SHARD_INDEX") as caught:
        print(worker_settings(env).group_member)
    assert "say the member too" in str(caught.value)


def test_hpa_and_autoscaled_workload_name_the_leader_worker_set() -> None:
    metric = {"type": "Resource", "name": "cpu", "target": {"type": "Utilization", "averageUtilization": 70}}
    spec = {
        **LWS,
        "autoscaling": {"decode": {"enabled": True, "driver": "hpa", "maxReplicas": 5, "metric": metric}},
    }
    hpa = rendered(spec)[("HorizontalPodAutoscaler", "chat-decode")]
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"]) == (LWS_API_VERSION, "LeaderWorkerSet")
    assert ("LeaderWorkerSet", "chat-decode") in autoscaled_workloads("chat", s.parse_spec(spec))


def test_status_counts_lws_groups_and_needs_no_observed_generation() -> None:
    spec = s.parse_spec(LWS)
    owner = Owner("chat", NS, "u-1")
    decode = {"kind": "LeaderWorkerSet", "metadata": {"generation": 4}, "spec": {"replicas": 3}}
    decode["status"] = {"replicas": 3, "readyReplicas": 3, "updatedReplicas": 3}  # LWS: no observedGeneration
    assert st.Workload.of(decode).current_generation
    pods = tuple((g * 4 + m, not (g == 2 and m == 3)) for g in range(3) for m in range(4))  # one member down
    out = st.compute(owner, spec, 1, st.Observed(decode=decode, decode_pods=pods), None, "now")
    assert out.decode.replicas == 3 and out.decode.ready == 2  # complete groups only
    assert out.decode.workload_kind == "LeaderWorkerSet"


@pytest.mark.parametrize(("status", "says"), [(404, "install LeaderWorkerSet"), (403, "leaderWorkerSet.enabled=true")])
def test_no_lws_api_or_grant_is_a_clear_condition_not_a_quiet_statefulset(status: int, says: str) -> None:
    kube = fake_kube()
    kube.inner.create(service("chat", NS, LWS))
    kube.on("create", "LeaderWorkerSet", error=KubeError(status, "x", "refused", "POST", "/apis/..."), times=-1)
    out = reconcile(reconciler(kube), NS, "chat")
    assert out is not None and "Deployment/chat-router" in out.created
    assert not any(a.kind == "StatefulSet" for a in kube.writes())
    now = kube.inner.get(PDIS, NS, "chat")["status"]
    degraded = next(c for c in now["conditions"] if c["type"] == "Degraded")
    assert now["phase"] in ("Degraded", "Pending") and degraded["status"] == "True"
    assert "LeaderWorkerSet/chat-decode" in degraded["message"] and says in degraded["message"], degraded
    assert "workloadKind" not in now["decode"]  # nothing runs the decode: no kind recorded


def test_a_statefulset_service_never_reads_the_lws_api() -> None:
    """A cluster without LWS (or an operator without its grant) sees no LWS call at all."""
    kube = fake_kube()
    kube.inner.create(service("chat", NS, {"decode": {"layerShards": 2}}))
    rec = reconciler(kube)
    reconcile(rec, NS, "chat")
    kube.inner.merge_patch(PDIS, NS, "chat", {"spec": {"decode": {"replicas": 2}}})
    reconcile(rec, NS, "chat")
    assert not [a for a in kube.actions if a.kind == "LeaderWorkerSet"]
    assert kube.inner.get(PDIS, NS, "chat")["status"]["decode"]["workloadKind"] == "StatefulSet"


def test_a_reconcile_mid_switch_counts_only_its_own_kinds_pods() -> None:
    """Switching to a LeaderWorkerSet while the StatefulSet's pods still run: those pods (no
    LWS labels) match the decode selector too, and must neither crash nor count."""
    kube = fake_kube()
    kube.inner.create(service("chat", NS, LWS))
    labels = child_labels("chat", "decode")
    for name, extra in (("chat-decode-5", {}), ("chat-decode-1", {lws.GROUP_INDEX: "1", lws.WORKER_INDEX: "0"})):
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "labels": {**labels, **extra}},
        }
        pod["status"] = {"conditions": [{"type": "Ready", "status": "True"}]}
        kube.inner.create(pod)
    out = reconcile(reconciler(kube), NS, "chat")
    assert out is not None and "LeaderWorkerSet/chat-decode" in out.created
    assert kube.inner.get(PDIS, NS, "chat")["status"]["decode"]["ready"] == 0  # one member of a 4-pod group
