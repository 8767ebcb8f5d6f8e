"""The InferencePool of the service's routers (Gateway API Inference Extension)."""

from __future__ import annotations

from typing import Any

from pdserve_common import pod_env as E
from pdserve_operator import spec as s
from pdserve_operator.reconcile.children.meta import Owner, epp_service_name, object_meta, selector_labels
from pdserve_operator.reconcile.children.services import epp_service

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


def gateway_children(owner: Owner, spec: s.PDInferenceServiceSpec) -> list[dict[str, Any]]:
    if not spec.router.inference_pool.enabled or spec.router.endpoint_picker_port is None:
        return []
    return [epp_service(owner, spec.router.endpoint_picker_port), inference_pool(owner, spec)]
