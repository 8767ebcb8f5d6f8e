"""PDScalingAdapter: a scale target per role (`kubectl scale pdsa/NAME-prefill`, an HPA, KEDA).

A custom resource has exactly one scale subresource, and PDInferenceService's is decode's
groups; prefill could not be scaled by kubectl, an HPA or KEDA at all. Dynamo answers this with
one small adapter object per role, each with its own /scale; so does pdserve. The operator
makes one per role (`NAME-prefill`, `NAME-decode`), owned by the service, and keeps its
`spec.replicas` and the service's `spec.<role>.replicas` equal (reconcile/scaling_adapters.py says who
wins when both moved). The object holds no configuration of its own: it is a handle.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pdserve_operator.spec.base import DNS_LABEL, GROUP, Model

ADAPTER_KIND = "PDScalingAdapter"
ADAPTER_PLURAL = "pdscalingadapters"
ADAPTER_SINGULAR = "pdscalingadapter"
ADAPTER_SHORT_NAMES = ("pdsa",)
ADAPTER_ROLES = ("prefill", "decode")
ADAPTER_CRD_NAME = f"{ADAPTER_PLURAL}.{GROUP}"


class ScalingAdapterSpec(Model):
    """Which role of which service, and how many of it (prefill pods, decode groups)."""

    replicas: int = Field(
        ge=0, le=1024, description="The role's replicas: prefill pods, decode groups (the scale subresource)."
    )
    service_name: str = Field(
        min_length=1, max_length=63, pattern=DNS_LABEL, description="The PDInferenceService (same namespace)."
    )
    role: Literal["prefill", "decode"] = Field(description="The role this adapter scales.")


IMMUTABLE_TARGET = {
    "rule": "self.serviceName == oldSelf.serviceName && self.role == oldSelf.role",
    "message": "serviceName and role are fixed when the adapter is made",
}


class ScalingAdapterStatus(Model):
    """What an HPA reads through /scale: the role's current count and its pods' selector."""

    replicas: int = Field(0, ge=0, description="The role's current replicas (prefill pods, decode groups).")
    selector: str = Field("", description="Label selector of the role's pods (for an HPA's pod metrics).")
    observed_generation: int = Field(
        0, ge=0, description="The adapter generation whose replicas the service has taken (or refused)."
    )


ADAPTER_SCALE = {
    "specReplicasPath": ".spec.replicas",
    "statusReplicasPath": ".status.replicas",
    "labelSelectorPath": ".status.selector",
}
