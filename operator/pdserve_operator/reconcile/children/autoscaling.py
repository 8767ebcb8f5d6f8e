"""HorizontalPodAutoscalers (driver hpa) and PDScalingAdapters (a /scale handle per role)."""

from __future__ import annotations

from typing import Any

from pdserve_operator import spec as s
from pdserve_operator.reconcile.children.disaggregated_set import role_scaler_ref
from pdserve_operator.reconcile.children.meta import Owner, adapter_name, hpa_name, object_meta, quantity, workload_name
from pdserve_operator.reconcile.children.workloads import decode_kind
from pdserve_operator.spec import scaling_adapter as sa


def _metric_spec(metric: s.HPAMetric) -> dict[str, Any]:
    t = metric.target
    target: dict[str, Any] = {"type": t.type}
    if t.average_utilization is not None:
        target["averageUtilization"] = t.average_utilization
    if t.average_value is not None:
        target["averageValue"] = quantity(t.average_value)
    if t.value is not None:
        target["value"] = quantity(t.value)
    if metric.type == "Resource":
        return {"type": "Resource", "resource": {"name": metric.name, "target": target}}
    ident: dict[str, Any] = {"name": metric.name}
    if metric.selector:
        ident["selector"] = {"matchLabels": dict(metric.selector)}
    key = "pods" if metric.type == "Pods" else "external"
    return {"type": metric.type, key: {"metric": ident, "target": target}}


def horizontal_pod_autoscaler(owner: Owner, role: str, spec: s.PDInferenceServiceSpec) -> dict[str, Any]:
    """An autoscaling/v2 HPA on the role's workload, for driver hpa. Its windows are the spec's."""
    a = spec.autoscaling
    assert a is not None
    r: s.RoleAutoscaling = getattr(a, role)
    assert r.metric is not None
    api, kind = ("apps/v1", "Deployment") if role == "prefill" else decode_kind(spec)
    target = {"apiVersion": api, "kind": kind, "name": workload_name(owner.name, role)}
    if spec.workload == "DisaggregatedSet":  # the role's upstream scaler (an External role)
        target = role_scaler_ref(owner.name, role)
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": object_meta(owner, hpa_name(owner.name, role), role),
        "spec": {
            "scaleTargetRef": target,
            "minReplicas": s.effective_min(spec, role),
            "maxReplicas": r.max_replicas,
            "metrics": [_metric_spec(r.metric)],
            "behavior": {
                "scaleUp": {"stabilizationWindowSeconds": a.scale_up_window_seconds},
                "scaleDown": {"stabilizationWindowSeconds": a.scale_down_window_seconds},
            },
        },
    }


def hpa_roles(spec: s.PDInferenceServiceSpec) -> list[str]:
    a = spec.autoscaling
    return [
        r for r in ("prefill", "decode") if a is not None and getattr(a, r).enabled and getattr(a, r).driver == "hpa"
    ]


def scaling_adapter(owner: Owner, role: str, replicas: int) -> dict[str, Any]:
    """The role's PDScalingAdapter: a /scale handle on spec.<role>.replicas (scaling_adapters.py)."""
    return {
        "apiVersion": s.API_VERSION,
        "kind": sa.ADAPTER_KIND,
        "metadata": object_meta(owner, adapter_name(owner.name, role), role),
        "spec": {"replicas": replicas, "serviceName": owner.name, "role": role},
    }
