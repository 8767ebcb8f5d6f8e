"""Prefill and decode as the roles of one DisaggregatedSet (spec.workload DisaggregatedSet).

The DisaggregatedSet (sigs.k8s.io/lws, disaggregatedset.x-k8s.io/v1, checked against lws
060ab4da) makes one LeaderWorkerSet per role per slice, named `NAME-SLICE-REVISION-ROLE`. Each
role here is the LWS that pdserve would render for it: prefill groups of one pod, decode groups
of `layerShards` pods restarted as one (RecreateGroupOnPodRestart), both started together and
rolled one group at a time without a surplus group. Role replicas are per slice (the spec's are
totals). Roles are `Static`: pdserve writes their replicas (its PDScalingAdapters), since
upstream cannot yet combine slices with its role scaler (lws #948).
"""

from __future__ import annotations

from typing import Any

from pdserve_operator import spec as s
from pdserve_operator.reconcile.children.meta import DS_API_VERSION, Defaults, Owner, object_meta
from pdserve_operator.reconcile.children.pod import pod_template

DS_KIND = "DisaggregatedSet"
ROLES = ("prefill", "decode")


def ds_name(name: str) -> str:
    return name


def _role(owner: Owner, role: str, spec: s.PDInferenceServiceSpec, defaults: Defaults) -> dict[str, Any]:
    size = spec.decode.layer_shards if role == "decode" else 1
    replicas: int = getattr(spec, role).replicas // spec.disaggregated_set.slices
    return {
        "name": role,
        "scaling": {"mode": "Static"},
        "spec": {
            "replicas": replicas,
            "leaderWorkerTemplate": {
                "size": size,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "workerTemplate": pod_template(owner, role, spec, defaults),
            },
            "startupPolicy": "LeaderCreated",
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {"maxUnavailable": 1, "maxSurge": 0},
            },
            "networkConfig": {"subdomainPolicy": "Shared"},
        },
    }


def disaggregated_set(owner: Owner, spec: s.PDInferenceServiceSpec, defaults: Defaults) -> dict[str, Any]:
    """The service's DisaggregatedSet: both roles, `slices` copies, placed as the spec asks."""
    ds = spec.disaggregated_set
    body: dict[str, Any] = {
        "slices": ds.slices,
        "roles": [_role(owner, role, spec, defaults) for role in ROLES],
    }
    if ds.placement != "None":
        body["placementPolicy"] = {"type": ds.placement, "topology": ds.topology_key}
    return {
        "apiVersion": DS_API_VERSION,
        "kind": DS_KIND,
        "metadata": object_meta(owner, ds_name(owner.name)),
        "spec": body,
    }


def role_workload(ds: dict[str, Any] | None, role: str) -> dict[str, Any] | None:
    """One role of a live DisaggregatedSet seen as a workload (status counts of groups), so the
    status reads it as it reads a LeaderWorkerSet: `status.roleStatuses[role]`, totals over the
    slices; absent until the controller first reports the role."""
    if ds is None:
        return None
    for entry in (ds.get("status") or {}).get("roleStatuses") or []:
        if entry.get("name") == role:
            counts = {k: int(entry.get(k) or 0) for k in ("replicas", "readyReplicas", "updatedReplicas")}
            return {"kind": "LeaderWorkerSet", "metadata": {}, "status": counts}
    return {"kind": "LeaderWorkerSet", "metadata": {}, "status": {}}
