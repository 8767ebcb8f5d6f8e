"""Prefill and decode as the roles of one DisaggregatedSet (spec.workload DisaggregatedSet).

The DisaggregatedSet (sigs.k8s.io/lws, disaggregatedset.x-k8s.io/v1, checked against lws
060ab4da) makes one LeaderWorkerSet per role per slice, named `NAME-SLICE-REVISION-ROLE`. Each
role here is the LWS that pdserve would render for it: prefill groups of one pod, decode groups
of `layerShards` pods restarted as one (RecreateGroupOnPodRestart), both started together and
rolled one group at a time without a surplus group. Role replicas are per slice (the spec's are
totals). A role is `Static` (pdserve writes its replicas, through its PDScalingAdapters) unless
it autoscales (driver hpa, one slice: spec/disaggregated.py): then it is `External`, and the
HPA scales the DisaggregatedSetRoleScaler the set's controller makes for it (`NAME-ROLE`, lws
pkg/controllers/disaggregatedset/scaler_manager.go ScalerName), seeded from the role's count.
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
        "scaling": {"mode": "External" if s.autoscaled(spec, role) else "Static"},
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
    """One role of a live DisaggregatedSet seen as a workload of groups, so the status reads it
    as it reads a LeaderWorkerSet: counts from `status.roleStatuses[role]` (totals over the
    slices, zero until the controller reports the role); the count asked for is the role's
    replicas times the slices, or for an External role the count running (its scaler's)."""
    if ds is None:
        return None
    spec = ds.get("spec") or {}
    entry: dict[str, Any] = next(
        (r for r in (ds.get("status") or {}).get("roleStatuses") or [] if r.get("name") == role), {}
    )
    counts = {k: int(entry.get(k) or 0) for k in ("replicas", "readyReplicas", "updatedReplicas")}
    declared: dict[str, Any] = next((r for r in spec.get("roles") or [] if r.get("name") == role), {})
    external = (declared.get("scaling") or {}).get("mode") == "External"
    per_slice = int((declared.get("spec") or {}).get("replicas") or 0)
    asked = counts["replicas"] if external else per_slice * int(spec.get("slices") or 1)
    return {"kind": "LeaderWorkerSet", "metadata": {}, "spec": {"replicas": asked}, "status": counts}


ROLE_SCALER_KIND = "DisaggregatedSetRoleScaler"


def role_scaler_ref(name: str, role: str) -> dict[str, str]:
    """An HPA's scaleTargetRef on the role scaler of an External role."""
    return {"apiVersion": DS_API_VERSION, "kind": ROLE_SCALER_KIND, "name": f"{ds_name(name)}-{role}"}
