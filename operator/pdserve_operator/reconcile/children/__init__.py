"""Spec → the Kubernetes objects a PDInferenceService owns. Pure: no I/O, no clock, no randomness.

`render(owner, spec, token, defaults)` returns every child as a plain dict, in the order they
should be applied (Secret and ConfigMap before the pods that mount them). The reconciler applies
them idempotently and compares them with what is live (`reconcile/drift.py`), so everything
rendered here must be stable for equal inputs and must not contain fields the API server drops
(empty strings, false booleans, empty lists): those would read as drift forever.

One module per kind: `secret`, `config_map`, `workloads` (Deployments, the decode StatefulSet
or LeaderWorkerSet), `disaggregated_set` (both roles in one), `services`, `inference_pool` (and
its objectives), `autoscaling` (HPAs, PDScalingAdapters) and `policy` (NetworkPolicy,
PodDisruptionBudgets); `pod` and `env` build the pod template they share, `meta` the names,
labels and `Owner`/`Defaults`. Decode layer sharding: a decode group is `layerShards` pods,
each deriving its place from its ordinal (`pod_env.group_member`).
"""

from __future__ import annotations

from typing import Any

from pdserve_operator import spec as s
from pdserve_operator.reconcile.children.autoscaling import horizontal_pod_autoscaler, hpa_roles
from pdserve_operator.reconcile.children.config_map import config_map
from pdserve_operator.reconcile.children.disaggregated_set import disaggregated_set
from pdserve_operator.reconcile.children.inference_pool import gateway_children
from pdserve_operator.reconcile.children.meta import ROLES, Defaults, Owner
from pdserve_operator.reconcile.children.policy import disruption_budget, network_policy
from pdserve_operator.reconcile.children.secret import secret
from pdserve_operator.reconcile.children.services import headless_service, router_service
from pdserve_operator.reconcile.children.workloads import decode_workload, deployment


def workers(owner: Owner, spec: s.PDInferenceServiceSpec, defaults: Defaults) -> list[dict[str, Any]]:
    """What runs prefill and decode (spec.workload): one DisaggregatedSet, or a Deployment and the decode workload."""
    if spec.workload == "DisaggregatedSet":
        return [disaggregated_set(owner, spec, defaults)]
    return [deployment(owner, "prefill", spec, defaults), decode_workload(owner, spec, defaults)]


def render(owner: Owner, spec: s.PDInferenceServiceSpec, token: str, defaults: Defaults) -> list[dict[str, Any]]:
    """Every child, in apply order (what pods mount exists before the pods)."""
    if not token:
        raise ValueError(f"empty broker token for {owner.key}")
    policy = [network_policy(owner, defaults, spec.router.endpoint_picker_port)] if defaults.network_policy else []
    return [
        *policy,  # before the pods, so no pod of the service ever runs unprotected
        secret(owner, token),
        config_map(owner, spec),
        headless_service(owner),
        router_service(owner, spec),
        *workers(owner, spec, defaults),
        deployment(owner, "router", spec, defaults),
        *gateway_children(owner, spec, defaults),  # after the routers they select
        *(disruption_budget(owner, role) for role in ROLES),
        *(horizontal_pod_autoscaler(owner, role, spec) for role in hpa_roles(spec)),
    ]
