"""The status subresource's fields (computed by pdserve_operator/reconcile/status.py, written by the operator only)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pdserve_operator.spec.base import Model

Phase = Literal["Pending", "Progressing", "Ready", "Degraded", "Invalid"]
ConditionType = Literal["Ready", "Progressing", "Degraded", "SpecValid"]


class Condition(Model):
    """A condition in the usual Kubernetes shape."""

    type: ConditionType = Field(description="Ready, Progressing, Degraded or SpecValid.")
    status: Literal["True", "False", "Unknown"] = Field(description="Whether the condition holds.")
    reason: str = Field(max_length=1024, description="CamelCase reason of the last transition.")
    message: str = Field("", max_length=32768, description="Human-readable details.")
    last_transition_time: str = Field(description="When status last changed (RFC 3339).")
    observed_generation: int = Field(0, ge=0, description="Generation the condition was computed for.")


class RoleStatus(Model):
    """Counts of one role."""

    desired: int = Field(0, ge=0, description="Pods (routers, prefill) or groups (decode) the spec asks for.")
    ready: int = Field(0, ge=0, description="Ready pods or complete ready groups.")
    registered: int | None = Field(
        None, ge=0, description="Workers registered with the broker (absent when the broker is not running)."
    )
    summary: str = Field("0/0", description="ready/desired, for printer columns.")


class DecodeStatus(RoleStatus):
    """Decode counts plus the fields the scale subresource reads."""

    replicas: int = Field(0, ge=0, description="Decode groups that currently exist (scale subresource status).")
    selector: str = Field("", description="Label selector of the decode pods (scale subresource).")
    workload_kind: Literal["StatefulSet", "LeaderWorkerSet", "DisaggregatedSet"] | None = Field(
        None,
        description="The kind of workload running the decode groups (spec.workload, decode.groupScheduling), once it "
        "exists: after a change of either the operator removes the workload of the kind named here.",
    )


class SlotStatus(Model):
    """KV slots across the ready decode groups."""

    used: int | None = Field(None, ge=0, description="Slots reserved by requests, when the broker reports it.")
    total: int = Field(0, ge=0, description="Slots of all ready decode groups.")
    summary: str = Field("0/0", description="used/total, for printer columns ('-' for unknown used).")


class RoleScalingStatus(Model):
    """Who scales one role, and what it last decided."""

    driver: Literal["planner", "hpa", "external"] = Field("planner", description="Who sets the role's replicas.")
    current: int = Field(0, ge=0, description="Replicas the workload asks for now (decode: groups).")
    desired: int = Field(0, ge=0, description="Replicas the driver wants (decode: groups).")
    reason: str = Field("", max_length=1024, description="Why, in words.")
    last_change_time: str | None = Field(None, description="When the operator last changed the count (RFC 3339).")


class AutoscalingStatus(Model):
    """The autoscalers' view, per role (absent for roles not autoscaled)."""

    prefill: RoleScalingStatus | None = Field(None, description="Prefill.")
    decode: RoleScalingStatus | None = Field(None, description="Decode.")
    summary: str = Field("", description="P:current[->desired] D:current[->desired], for printer columns.")


class DrainStatus(Model):
    """The last decode scale-down's drain: what the decodes that went did with their requests."""

    decodes: list[str] = Field(default_factory=list, description="The decode groups drained (their leader pods).")
    migrated: int = Field(0, ge=0, description="Requests handed over with their KV to another decode.")
    failed: int = Field(0, ge=0, description="Handed-over requests the router resumed by re-prefill instead.")
    running: int = Field(
        0, ge=0, description="Requests still running when the StatefulSet was lowered (drain timed out)."
    )
    seconds: float = Field(0.0, ge=0, description="From marking the decodes draining to lowering the StatefulSet.")
    time: str = Field("", description="When the StatefulSet was lowered (RFC 3339).")


class KVStatus(Model):
    """KV capacity in tokens across the ready decode groups."""

    used: int | None = Field(None, ge=0, description="KV tokens reserved by requests, when the broker reports it.")
    total: int = Field(0, ge=0, description="KV tokens of all ready decode groups.")
    summary: str = Field("0/0", description="used/total, for printer columns ('-' for unknown used).")


class PDInferenceServiceStatus(Model):
    """Observed state, written by the operator only."""

    phase: Phase = Field("Pending", description="Pending, Progressing, Ready, Degraded or Invalid.")
    observed_generation: int = Field(0, ge=0, description="The spec generation this status describes.")
    conditions: list[Condition] = Field(default_factory=list, description="Ready, Progressing, Degraded, SpecValid.")
    prefill: RoleStatus = Field(default_factory=RoleStatus, description="Prefill pods.")
    decode: DecodeStatus = Field(default_factory=DecodeStatus, description="Decode groups.")
    router: RoleStatus = Field(default_factory=RoleStatus, description="Router pods.")
    slots: SlotStatus = Field(default_factory=SlotStatus, description="KV slot usage.")
    kv_tokens: KVStatus = Field(default_factory=KVStatus, description="KV token usage (blocks in use x block size).")
    endpoint: str = Field("", description="In-cluster URL of the OpenAI-compatible API.")
    autoscaling: AutoscalingStatus | None = Field(None, description="Autoscaling decisions (with spec.autoscaling).")
    last_drain: DrainStatus | None = Field(None, description="The last decode scale-down's drain (docs/migration.md).")

    def condition(self, type_: str) -> Condition | None:
        return next((c for c in self.conditions if c.type == type_), None)
