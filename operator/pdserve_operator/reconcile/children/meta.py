"""Names, labels and object metadata of a service's children; `Owner` and `Defaults`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve_operator import spec as s

LABEL_NAME = "app.kubernetes.io/name"


LABEL_INSTANCE = "app.kubernetes.io/instance"


LABEL_COMPONENT = "app.kubernetes.io/component"


LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"


MANAGED_BY = "pdserve-operator"


APP = "pdserve"


# Labels of the operator's own pods (the Helm chart sets them): a NetworkPolicy peer.
OPERATOR_POD_LABELS = {LABEL_NAME: "pdserve-operator"}


ROLES = ("prefill", "decode", "router")


@dataclass(frozen=True)
class Owner:
    """The PDInferenceService children belong to (what ownerReferences need)."""

    name: str
    namespace: str
    uid: str

    @property
    def key(self) -> str:
        """The broker's service key."""
        return f"{self.namespace}/{self.name}"


# The vLLM variants of the worker image by device.type (worker/Dockerfile with ENGINE=vllm, tagged
# as its header says): a service with engine vllm that sets no vllmImage runs these for prefill and decode.
VLLM_IMAGES = {"cpu": "pdserve:0.1.0-vllm-cpu", "cuda": "pdserve:0.1.0-vllm-cuda", "npu": "pdserve:0.1.0-vllm-ascend"}


@dataclass(frozen=True)
class Defaults:
    """Operator-wide settings that the spec may leave unset."""

    image: str
    broker_address: str
    vllm_images: dict[str, str] = field(default_factory=lambda: dict(VLLM_IMAGES))  # by device.type
    image_pull_policy: str = "IfNotPresent"
    # A NetworkPolicy per service (see `network_policy`). On by default: real HIXL admits any
    # peer that reaches its port, so the policy is what keeps other pods off the KV plane
    # (a cluster without a policy-enforcing CNI ignores it; one with a default-deny needs it).
    network_policy: bool = True
    operator_namespace: str = "pdserve-system"  # where the operator pods run (a policy peer)
    # The operator's broker speaks (mutual) TLS: workers must dial it with TLS and present their
    # service's certificate (spec.tls), issued by the same CA as the broker's.
    broker_tls: bool = False
    # The group of rendered InferenceObjectives: llm-d-router's now, the Inference Extension's up to v1.5.
    objective_api_version: str = "llm-d.ai/v1alpha2"


def secret_name(name: str) -> str:
    return f"{name}-broker-token"


def config_name(name: str) -> str:
    return f"{name}-config"


def workload_name(name: str, role: str) -> str:
    return f"{name}-{role}"


def headless_name(name: str) -> str:
    return f"{name}-decode-headless"


def router_service_name(name: str) -> str:
    """The router Service carries the resource's own name: it is the service users call."""
    return name


def selector_labels(name: str, role: str | None = None) -> dict[str, str]:
    labels = {LABEL_NAME: APP, LABEL_INSTANCE: name}
    if role is not None:
        labels[LABEL_COMPONENT] = role
    return labels


def labels(name: str, role: str | None = None) -> dict[str, str]:
    return {**selector_labels(name, role), LABEL_MANAGED_BY: MANAGED_BY}


def selector_string(name: str, role: str) -> str:
    """A label selector in the string form the scale subresource reports."""
    return ",".join(f"{k}={v}" for k, v in selector_labels(name, role).items())


def endpoint(owner: Owner, spec: s.PDInferenceServiceSpec) -> str:
    scheme = "https" if spec.tls is not None else "http"
    return f"{scheme}://{router_service_name(owner.name)}.{owner.namespace}.svc:{spec.router.service.port}/v1"


def tls_server_name(owner: Owner, spec: s.PDInferenceServiceSpec) -> str:
    """The name peers check the service's certificate under: spec.tls.serverName, else the
    router Service's DNS name (which the certificate needs for HTTPS clients anyway)."""
    assert spec.tls is not None
    return spec.tls.server_name or f"{router_service_name(owner.name)}.{owner.namespace}.svc"


def owner_reference(owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": s.API_VERSION,
        "kind": s.KIND,
        "name": owner.name,
        "uid": owner.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def object_meta(owner: Owner, name: str, role: str | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": labels(owner.name, role),
        "ownerReferences": [owner_reference(owner)],
        **extra,
    }


def quantity(value: int | str) -> str:
    """Quantities as the API server returns them (strings), so comparisons are like with like."""
    return str(value)


def hpa_name(name: str, role: str) -> str:
    return workload_name(name, role)


# LeaderWorkerSet (sigs.k8s.io/lws, api/leaderworkerset/v1): its API, and the labels its
# controller puts on every pod of a group (the leader's worker-index is 0).
LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"


LWS_GROUP_INDEX = "leaderworkerset.sigs.k8s.io/group-index"


LWS_WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"


LWS_NAME = "leaderworkerset.sigs.k8s.io/name"


# DisaggregatedSet (sigs.k8s.io/lws, api/disaggregatedset/v1): prefill and decode as its roles.
DS_API_VERSION = "disaggregatedset.x-k8s.io/v1"


def decode_in_lws_groups(spec: s.PDInferenceServiceSpec) -> bool:
    """Whether LWS runs the decode groups (its labels place a pod): as a LeaderWorkerSet of ours, or
    as the decode role of a DisaggregatedSet (whose controller makes one LWS per slice)."""
    return spec.workload != "Deployments" or spec.decode.group_scheduling == "leaderWorkerSet"


def epp_service_name(name: str) -> str:
    return f"{name}-epp"


def adapter_name(name: str, role: str) -> str:
    return f"{name}-{role}"


def network_policy_name(name: str) -> str:
    return f"{name}-workers"
