"""spec.workload DisaggregatedSet (issue #57 item 2): prefill and decode as the roles of one
DisaggregatedSet, on the reconciler with the recording fake. The rendered object is checked
against the upstream CRD in test_upstream_crds.py; here: what is rendered, how each decode pod
finds its group, the status read back per role, the refusal by name where the API is absent, and
what a switch of spec.workload removes (and leaves running)."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve_operator import spec as s
from pdserve_operator.kube import KINDS, PDIS, KubeError
from pdserve_operator.reconcile.children import render
from pdserve_operator.reconcile.children.config_map import config_hash, service_config
from pdserve_operator.reconcile.children.meta import Owner, secret_name, selector_labels
from support import leaderworkerset as lws
from support.kube_fake import DEFAULTS, fake_kube, reconcile, reconciler, service
from support.worker_env import worker_settings

NS = "team"
CPU = {"type": "Resource", "name": "cpu", "target": {"type": "Utilization", "averageUtilization": 70}}
DS = {"workload": "DisaggregatedSet", "prefill": {"replicas": 2}, "decode": {"replicas": 2}}
SLICED = {
    "workload": "DisaggregatedSet",
    "disaggregatedSet": {"slices": 2, "placement": "ExclusiveSlice", "topologyKey": "example.com/rack"},
    "prefill": {"replicas": 4},
    "decode": {"replicas": 2, "layerShards": 3},
}


def rendered(spec: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    owner = Owner("chat", NS, "u-1")
    return {(o["kind"], o["metadata"]["name"]): o for o in render(owner, s.parse_spec(spec), "t", DEFAULTS)}


def roles(ds: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["name"]: r["spec"] for r in ds["spec"]["roles"]}


def test_both_roles_in_one_set_with_per_slice_replicas_and_the_placement_asked_for() -> None:
    kids = rendered(SLICED)
    assert ("Deployment", "chat-prefill") not in kids and ("StatefulSet", "chat-decode") not in kids
    assert ("Deployment", "chat-router") in kids  # the router stays a Deployment
    ds = kids[("DisaggregatedSet", "chat")]
    assert ds["apiVersion"] == "disaggregatedset.x-k8s.io/v1" and ds["spec"]["slices"] == 2
    assert ds["spec"]["placementPolicy"] == {"type": "ExclusiveSlice", "topology": "example.com/rack"}
    by = roles(ds)
    assert [r["name"] for r in ds["spec"]["roles"]] == ["prefill", "decode"]
    assert by["prefill"]["replicas"] == 2 and by["decode"]["replicas"] == 1  # per slice: totals / slices
    assert by["prefill"]["leaderWorkerTemplate"]["size"] == 1 and by["decode"]["leaderWorkerTemplate"]["size"] == 3
    for role, spec in by.items():
        labels = spec["leaderWorkerTemplate"]["workerTemplate"]["metadata"]["labels"]
        assert selector_labels("chat", role).items() <= labels.items()  # Services and PDBs still select them
    assert "placementPolicy" not in rendered(DS)[("DisaggregatedSet", "chat")]["spec"]  # None: left to upstream


def test_every_decode_pod_of_a_slice_finds_its_group_from_its_own_lws() -> None:
    """The DisaggregatedSet's controller names each slice's decode LWS NAME-SLICE-REVISION-decode
    (lws pkg/utils/disaggregatedset/utils.go GenerateName): the peers come from the pod's label."""
    kids = rendered(SLICED)
    ds, secret = kids[("DisaggregatedSet", "chat")], kids[("Secret", secret_name("chat"))]
    decode = roles(ds)["decode"]["leaderWorkerTemplate"]
    template = decode["workerTemplate"]
    for slice_ in range(2):
        name = f"chat-{slice_}-5f7d9c-decode"
        obj = {"metadata": {"name": name}, "spec": {"leaderWorkerTemplate": decode}}
        names = lws.pod_names(name, 0, 3)
        for worker, pod in enumerate(names):
            env = worker_settings(lws.pod_environ(template, pod, lws.pod_labels(obj, 0, worker), secret))
            assert env.group_member == (0, worker)
            assert env.peers == [f"{n}.{name}:50051" for n in names]


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ({**DS, "prefill": {"replicas": 0}}, "scale to zero together"),
        ({**SLICED, "prefill": {"replicas": 3}}, "multiple of disaggregatedSet.slices"),
        ({**DS, "decode": {"groupScheduling": "leaderWorkerSet"}}, "a DisaggregatedSet's decode role"),
        ({**DS, "disaggregatedSet": {"placement": "ExclusiveSlice"}}, "placement needs topologyKey"),
        (
            {**DS, "autoscaling": {"slo": {"ttftMs": 500}, "decode": {"enabled": True, "maxReplicas": 4}}},
            "kubectl scale pdsa/NAME-ROLE",
        ),
        (
            {**SLICED, "autoscaling": {"decode": {"enabled": True, "driver": "hpa", "maxReplicas": 4, "metric": CPU}}},
            "only with slices 1",
        ),
    ],
    ids=["zero", "slices", "group-scheduling", "placement", "planner", "hpa-with-slices"],
)
def test_what_a_disaggregated_set_cannot_run_is_refused_with_the_reason(spec: dict[str, Any], says: str) -> None:
    with pytest.raises(s.ValidationError, match=says):
        s.parse_spec(spec)


def test_status_reads_each_role_back_from_the_sets_role_statuses() -> None:
    kube = fake_kube()
    kube.inner.create(service("chat", NS, DS))
    rec = reconciler(kube)
    reconcile(rec, NS, "chat")
    ds_kind = KINDS["DisaggregatedSet"]
    counts = [
        {"name": "prefill", "replicas": 2, "readyReplicas": 2, "updatedReplicas": 2},
        {"name": "decode", "replicas": 2, "readyReplicas": 1, "updatedReplicas": 2},
    ]
    kube.inner.merge_patch(ds_kind, NS, "chat", {"status": {"roleStatuses": counts}}, "status")
    reconcile(rec, NS, "chat")
    status = kube.inner.get(PDIS, NS, "chat")["status"]
    assert (status["prefill"]["ready"], status["prefill"]["desired"]) == (2, 2)
    assert (status["decode"]["ready"], status["decode"]["replicas"]) == (1, 2)
    assert status["decode"]["workloadKind"] == "DisaggregatedSet"
    assert "decode 1/2 ready" in next(c for c in status["conditions"] if c["type"] == "Ready")["message"]


@pytest.mark.parametrize(("code", "says"), [(404, "install DisaggregatedSet"), (403, "disaggregatedSet.enabled=true")])
def test_no_api_or_grant_is_refused_by_name_and_the_running_workloads_stay(code: int, says: str) -> None:
    kube = fake_kube()
    kube.inner.create(service("chat", NS, {"prefill": {"replicas": 2}, "decode": {"replicas": 2}}))
    rec = reconciler(kube)
    reconcile(rec, NS, "chat")  # Deployments: a prefill Deployment and a decode StatefulSet
    kube.on("create", "DisaggregatedSet", error=KubeError(code, "x", "refused", "POST", "/apis/..."), times=-1)
    kube.inner.merge_patch(PDIS, NS, "chat", {"spec": {"workload": "DisaggregatedSet"}})
    reconcile(rec, NS, "chat")
    status = kube.inner.get(PDIS, NS, "chat")["status"]
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and "DisaggregatedSet/chat" in degraded["message"], degraded
    assert says in degraded["message"]
    assert not [a for a in kube.writes() if a.verb == "delete"]  # nothing removed: the old workloads serve on
    assert kube.inner.get(KINDS["StatefulSet"], NS, "chat-decode") is not None


def test_a_switch_removes_what_ran_before_only_once_the_new_exists_and_never_the_router() -> None:
    kube = fake_kube()
    kube.inner.create(service("chat", NS, {"prefill": {"replicas": 2}, "decode": {"replicas": 2}}))
    rec = reconciler(kube)
    reconcile(rec, NS, "chat")
    router = kube.inner.get(KINDS["Deployment"], NS, "chat-router")
    kube.inner.merge_patch(PDIS, NS, "chat", {"spec": {"workload": "DisaggregatedSet"}})
    reconcile(rec, NS, "chat")
    assert kube.inner.get(KINDS["DisaggregatedSet"], NS, "chat") is not None
    assert kube.inner.get(KINDS["Deployment"], NS, "chat-prefill") is None
    assert kube.inner.get(KINDS["StatefulSet"], NS, "chat-decode") is None
    after = kube.inner.get(KINDS["Deployment"], NS, "chat-router")
    assert after["metadata"]["uid"] == router["metadata"]["uid"]  # not recreated
    assert after["spec"]["template"] == router["spec"]["template"]  # not rolled either
    assert kube.inner.get(PDIS, NS, "chat")["status"]["decode"]["workloadKind"] == "DisaggregatedSet"
    reasons = [e[3] for e in kube.inner.events if e[3] == "DecodeWorkloadReplaced"]
    assert len(reasons) == 2, kube.inner.events
    # And back: the set goes once the Deployment and the StatefulSet exist again.
    kube.inner.merge_patch(PDIS, NS, "chat", {"spec": {"workload": "Deployments"}})
    reconcile(rec, NS, "chat")
    assert kube.inner.get(KINDS["DisaggregatedSet"], NS, "chat") is None
    assert kube.inner.get(KINDS["StatefulSet"], NS, "chat-decode") is not None
    assert kube.inner.get(KINDS["Deployment"], NS, "chat-router")["metadata"]["uid"] == router["metadata"]["uid"]


def test_the_pods_config_hash_ignores_the_workload_and_the_gateways_objectives() -> None:
    """What runs the pods, and the gateway's objectives, are no pod's business: a change of them
    (or an operator upgrade that adds these fields at their defaults) must roll no pod: they are
    not in what the hash is taken of."""
    plain = config_hash(s.parse_spec({}))
    config = service_config(s.parse_spec({"router": {"endpointPickerPort": 9002, "inferencePool": {"enabled": True}}}))
    assert not {"workload", "disaggregatedSet"} & set(config) and "objectives" not in config["router"]["inferencePool"]
    pool = {"endpointPickerPort": 9002, "inferencePool": {"enabled": True}}
    with_pool = config_hash(s.parse_spec({"router": pool}))
    objectives = {**pool, "inferencePool": {"enabled": True, "objectives": [{"name": "a", "priority": 3}]}}
    assert config_hash(s.parse_spec({"router": objectives})) == with_pool
    assert config_hash(s.parse_spec({"workload": "DisaggregatedSet", "disaggregatedSet": {"slices": 1}})) == plain


def test_an_autoscaled_role_is_external_and_its_hpa_scales_the_upstream_role_scaler() -> None:
    """With one slice, upstream's role scaler applies: the role is External and the HPA targets
    the DisaggregatedSetRoleScaler the set's controller names NAME-ROLE (scaler_manager.go)."""
    spec = {**DS, "autoscaling": {"decode": {"enabled": True, "driver": "hpa", "maxReplicas": 6, "metric": CPU}}}
    kids = rendered(spec)
    by = {r["name"]: r for r in kids[("DisaggregatedSet", "chat")]["spec"]["roles"]}
    assert by["decode"]["scaling"] == {"mode": "External"} and by["prefill"]["scaling"] == {"mode": "Static"}
    ref = kids[("HorizontalPodAutoscaler", "chat-decode")]["spec"]["scaleTargetRef"]
    assert ref == {
        "apiVersion": "disaggregatedset.x-k8s.io/v1",
        "kind": "DisaggregatedSetRoleScaler",
        "name": "chat-decode",
    }
