"""Pod-level settings every role may override (the shapes of a Pod spec's fields)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pdserve_operator.spec.base import Model, Quantity


class ResourceRequirements(Model):
    """Compute resources of a container, as in a Pod spec."""

    requests: dict[str, Quantity] = Field(
        default_factory=dict, description="Minimum resources the scheduler reserves (e.g. cpu: 2, memory: 8Gi)."
    )
    limits: dict[str, Quantity] = Field(default_factory=dict, description="Maximum resources the container may use.")


class Toleration(Model):
    """A toleration, as in a Pod spec: lets pods land on nodes with a matching taint."""

    key: str | None = Field(None, description="Taint key to match; empty with operator Exists matches all.")
    operator: Literal["Exists", "Equal"] = Field("Equal", description="How key and value are compared.")
    value: str | None = Field(None, description="Taint value to match with operator Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect to match; empty matches all effects."
    )
    toleration_seconds: int | None = Field(
        None, ge=0, description="With NoExecute: how long the pod stays bound after the taint appears."
    )


class EnvVar(Model):
    """An extra environment variable for the role's containers (a literal value)."""

    name: str = Field(pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$", max_length=256, description="Variable name.")
    value: str = Field("", description="Variable value.")


class PodOverrides(Model):
    """Pod-level settings a role may override; the operator's own settings win on conflict."""

    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements,
        description="Extra compute resources; the accelerator request comes from spec.device.",
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Node labels the role's pods must be scheduled onto."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, max_length=32, description="Taints the role's pods tolerate."
    )
    env: list[EnvVar] = Field(
        default_factory=list,
        max_length=64,
        description="Extra environment variables; PDSERVE_* variables set by the operator cannot be overridden.",
    )
