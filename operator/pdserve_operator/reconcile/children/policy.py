"""NetworkPolicy and PodDisruptionBudgets."""

from __future__ import annotations

from typing import Any

from pdserve_common import pod_env as E
from pdserve_operator.reconcile.children.meta import (
    OPERATOR_POD_LABELS,
    Defaults,
    Owner,
    network_policy_name,
    object_meta,
    selector_labels,
    workload_name,
)


def disruption_budget(owner: Owner, role: str) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": object_meta(owner, workload_name(owner.name, role), role),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(owner.name, role)}},
    }


def network_policy(owner: Owner, defaults: Defaults, epp_port: int | None = None) -> dict[str, Any]:
    """Only this service's pods (and the operator) reach its pods' gRPC and transfer ports.


    Prefill pushes KV into decode memory and routers drive both over gRPC; a pod of another
    service, or anything else in the cluster, has no business on those ports. The HTTP port
    stays open: routers serve the API on it, and Prometheus scrapes arrive there; so does a
    router's endpoint-picker port when the spec names one (the gateway dials it from its own
    namespace: docs/gateway.md). No rule names the probe port: Kubernetes always admits the
    kubelet's traffic from the pod's node, and nothing else needs it.
    """
    public = [{"port": E.HTTP_PORT, "protocol": "TCP"}]
    if epp_port is not None:
        public.append({"port": epp_port, "protocol": "TCP"})
    peers = selector_labels(owner.name)
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": object_meta(owner, network_policy_name(owner.name)),
        "spec": {
            "podSelector": {"matchLabels": peers},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [
                        {"podSelector": {"matchLabels": peers}},
                        {
                            "namespaceSelector": {
                                "matchLabels": {"kubernetes.io/metadata.name": defaults.operator_namespace}
                            },
                            "podSelector": {"matchLabels": dict(OPERATOR_POD_LABELS)},
                        },
                    ],
                    "ports": [
                        {"port": E.GRPC_PORT, "protocol": "TCP"},
                        {"port": E.TRANSFER_PORT, "protocol": "TCP"},
                    ],
                },
                {"ports": public},
            ],
        },
    }
