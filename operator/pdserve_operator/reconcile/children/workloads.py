"""Deployments (prefill, router) and the decode workload (StatefulSet or LeaderWorkerSet)."""

from __future__ import annotations

from typing import Any

from pdserve_operator import spec as s
from pdserve_operator.reconcile.children.meta import (
    LWS_API_VERSION,
    Defaults,
    Owner,
    decode_in_lws_groups,
    headless_name,
    object_meta,
    selector_labels,
    workload_name,
)
from pdserve_operator.reconcile.children.pod import pod_template


def initial_replicas(spec: s.PDInferenceServiceSpec, role: str) -> int:
    """The role's count as rendered: the spec's, or for an autoscaled role the count its
    workload is created with (its floor; with driver external, the spec's as written). Once
    the workload exists, an autoscaled role's count is never written by the operator's apply
    (`autoscaled_workloads`)."""
    replicas: int = getattr(spec, role).replicas
    if not s.autoscaled(spec, role):
        return replicas
    assert spec.autoscaling is not None
    return replicas if getattr(spec.autoscaling, role).driver == "external" else s.effective_min(spec, role)


def autoscaled_workloads(name: str, spec: s.PDInferenceServiceSpec) -> set[tuple[str, str]]:
    """(kind, name) of the workloads whose spec.replicas belongs to an autoscaler, not to us."""
    kinds = {"prefill": "Deployment", "decode": decode_kind(spec)[1]}
    return {(kinds[role], workload_name(name, role)) for role in kinds if s.autoscaled(spec, role)}


def deployment(owner: Owner, role: str, spec: s.PDInferenceServiceSpec, defaults: Defaults) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": object_meta(owner, workload_name(owner.name, role), role),
        "spec": {
            "replicas": initial_replicas(spec, role),
            "selector": {"matchLabels": selector_labels(owner.name, role)},
            "template": pod_template(owner, role, spec, defaults),
        },
    }


def decode_statefulset(owner: Owner, spec: s.PDInferenceServiceSpec, defaults: Defaults) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": object_meta(owner, workload_name(owner.name, "decode"), "decode"),
        "spec": {
            "replicas": decode_pods(spec),
            "serviceName": headless_name(owner.name),
            # Members of a group start together; ordered start would serialise model loads.
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector_labels(owner.name, "decode")},
            "template": pod_template(owner, "decode", spec, defaults),
            "updateStrategy": {"type": "RollingUpdate"},
        },
    }


def decode_leader_worker_set(owner: Owner, spec: s.PDInferenceServiceSpec, defaults: Defaults) -> dict[str, Any]:
    """The decode groups as one LeaderWorkerSet: a group of layerShards pods is created,
    scheduled, restarted and rolled as a unit (spec.decode.groupScheduling, docs/gang-scheduling.md).


    One template for leader and workers: a pod's place comes from LWS's labels (`_lws_env`).
    A member that restarts takes its whole group with it (RecreateGroupOnPodRestart): the
    others hold layers of requests the restarted one lost, so serving on without it is not
    possible. Rolling updates replace one group at a time and never add a surplus group (each
    holds a full model's worth of devices)."""
    name = workload_name(owner.name, "decode")
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": "LeaderWorkerSet",
        "metadata": object_meta(owner, name, "decode"),
        "spec": {
            "replicas": initial_replicas(spec, "decode"),
            "leaderWorkerTemplate": {
                "size": spec.decode.layer_shards,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "workerTemplate": pod_template(owner, "decode", spec, defaults),
            },
            "startupPolicy": "LeaderCreated",  # members start together: ordered start would serialise model loads
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {"maxUnavailable": 1, "maxSurge": 0},
            },
            "networkConfig": {"subdomainPolicy": "Shared"},
        },
    }


def decode_kind(spec: s.PDInferenceServiceSpec) -> tuple[str, str]:
    """(apiVersion, kind) of the decode workload (decode_groups.py says what differs)."""
    if decode_in_lws_groups(spec):  # (a DisaggregatedSet's decode role counts as its LWS would)
        return LWS_API_VERSION, "LeaderWorkerSet"
    return "apps/v1", "StatefulSet"


def decode_workload(owner: Owner, spec: s.PDInferenceServiceSpec, defaults: Defaults) -> dict[str, Any]:
    if decode_in_lws_groups(spec):
        return decode_leader_worker_set(owner, spec, defaults)
    return decode_statefulset(owner, spec, defaults)


def decode_pods(spec: s.PDInferenceServiceSpec) -> int:
    return initial_replicas(spec, "decode") * spec.decode.layer_shards
