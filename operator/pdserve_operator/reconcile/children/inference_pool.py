"""The InferencePool of the service's routers (Gateway API Inference Extension) and its
InferenceObjectives (llm-d-router's group, or the Inference Extension's up to v1.5)."""

from __future__ import annotations

from typing import Any

from pdserve_common import pod_env as E
from pdserve_operator import spec as s
from pdserve_operator.reconcile.children.meta import (
    Defaults,
    Owner,
    epp_service_name,
    object_meta,
    selector_labels,
)
from pdserve_operator.reconcile.children.services import epp_service
from pdserve_operator.spec.router import InferenceObjectiveSpec

INFERENCE_POOL_API = "inference.networking.k8s.io/v1"


def inference_pool(owner: Owner, spec: s.PDInferenceServiceSpec) -> dict[str, Any]:
    """The InferencePool of the service's routers, their pickers as its endpoint picker.


    Routers, not decode pods: a decode serves no HTTP, and the pairing state (broker loads,
    prefix history, admission) lives in the routers (docs/gateway.md says why)."""
    assert spec.router.endpoint_picker_port is not None  # RouterSpec's rule
    return {
        "apiVersion": INFERENCE_POOL_API,
        "kind": "InferencePool",
        "metadata": object_meta(owner, owner.name, "router"),
        "spec": {
            "selector": {"matchLabels": selector_labels(owner.name, "router")},
            "targetPorts": [{"number": E.HTTP_PORT}],
            "endpointPickerRef": {
                "name": epp_service_name(owner.name),
                "port": {"number": spec.router.endpoint_picker_port},
                "failureMode": spec.router.inference_pool.failure_mode,
            },
        },
    }


def objective_name(name: str, objective: str) -> str:
    return f"{name}-{objective}"


def inference_objective(owner: Owner, objective: InferenceObjectiveSpec, api_version: str) -> dict[str, Any]:
    """One InferenceObjective of the pool (both groups ship the same v1alpha2 schema): requests
    naming it in `x-gateway-inference-objective` get its priority in a gateway's flow control.
    The pool reference is written in full (group, kind), so the object reads the same stored."""
    return {
        "apiVersion": api_version,
        "kind": "InferenceObjective",
        "metadata": object_meta(owner, objective_name(owner.name, objective.name), "router"),
        "spec": {
            "poolRef": {"group": INFERENCE_POOL_API.split("/")[0], "kind": "InferencePool", "name": owner.name},
            "priority": objective.priority,
        },
    }


def gateway_children(owner: Owner, spec: s.PDInferenceServiceSpec, defaults: Defaults) -> list[dict[str, Any]]:
    if not spec.router.inference_pool.enabled or spec.router.endpoint_picker_port is None:
        return []
    objectives = [
        inference_objective(owner, o, defaults.objective_api_version) for o in spec.router.inference_pool.objectives
    ]
    return [epp_service(owner, spec.router.endpoint_picker_port), inference_pool(owner, spec), *objectives]
