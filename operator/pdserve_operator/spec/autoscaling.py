"""Who sets each role's replica count: the built-in planner, a rendered HPA or another controller."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from pdserve_operator.spec.base import Model, Quantity, Rule


class MetricTarget(Model):
    """The target of an HPA metric (autoscaling/v2 MetricTarget)."""

    type: Literal["Utilization", "AverageValue", "Value"] = Field(
        description="Which of the values below is the target."
    )
    average_utilization: int | None = Field(
        None, ge=1, le=10000, description="Percent of the pods' resource request (type Utilization, Resource metrics)."
    )
    average_value: Quantity | None = Field(None, description="Per-pod average (type AverageValue).")
    value: Quantity | None = Field(None, description="Total value (type Value, External metrics).")

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="(self.type == 'Utilization') == has(self.averageUtilization) && "
            "(self.type == 'AverageValue') == has(self.averageValue) && (self.type == 'Value') == has(self.value)",
            message="set exactly the value of the target's type: averageUtilization, averageValue or value",
            holds=lambda t: (
                (t.type == "Utilization") == (t.average_utilization is not None)
                and (t.type == "AverageValue") == (t.average_value is not None)
                and (t.type == "Value") == (t.value is not None)
            ),
        ),
    )


class HPAMetric(Model):
    """One metric of the HorizontalPodAutoscaler the operator renders (autoscaling/v2 MetricSpec).

    Resource: a container resource of the role's pods (cpu, memory). Pods: a per-pod metric from a
    metrics adapter, e.g. pdserve_prefill_queue_length or pdserve_decode_kv_slots_used (the
    workers' /metrics). External: a metric from outside the cluster's pods."""

    type: Literal["Resource", "Pods", "External"] = Field(description="Where the metric comes from.")
    name: str = Field(
        min_length=1,
        max_length=253,
        pattern=r"^[a-zA-Z_:][a-zA-Z0-9_:./-]*$",
        description="Resource name (cpu, memory) or the metric's name.",
    )
    selector: dict[str, str] = Field(
        default_factory=dict, description="Labels that select the metric's series (Pods, External)."
    )
    target: MetricTarget = Field(description="The value the HPA keeps the metric at.")

    # The pairs autoscaling/v2 accepts (kubernetes pkg/apis/autoscaling/validation: validateResourceSource
    # wants Utilization or AverageValue, validatePodsSource AverageValue only, validateExternalSource
    # Value or AverageValue); checked here so a bad pair fails at admission of the pdis, not later
    # as an HPA the operator cannot create.
    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="self.type != 'Resource' || self.target.type != 'Value'",
            message="a Resource metric's target is Utilization or AverageValue",
            holds=lambda m: m.type != "Resource" or m.target.type != "Value",
            field="target",
        ),
        Rule(
            cel="self.type != 'Pods' || self.target.type == 'AverageValue'",
            message="a Pods metric's target is AverageValue",
            holds=lambda m: m.type != "Pods" or m.target.type == "AverageValue",
            field="target",
        ),
        Rule(
            cel="self.type != 'External' || self.target.type != 'Utilization'",
            message="an External metric's target is Value or AverageValue",
            holds=lambda m: m.type != "External" or m.target.type != "Utilization",
            field="target",
        ),
        Rule(
            cel="self.type != 'Resource' || !has(self.selector) || size(self.selector) == 0",
            message="a Resource metric takes no selector",
            holds=lambda m: m.type != "Resource" or not m.selector,
            field="selector",
        ),
    )


class RoleAutoscaling(Model):
    """Who sets one role's replica count.

    Off: the operator, from the role's `replicas`. On: an autoscaler, and the operator never
    writes the workload's replicas after creating it. `replicas` then is a floor: the
    planner and a rendered HPA never go below max(minReplicas, replicas) (`kubectl scale
    pdis/NAME` raises decode's floor); with driver external it is only the count at creation."""

    enabled: bool = Field(False, description="Scale this role automatically.")
    driver: Literal["planner", "hpa", "external"] = Field(
        "planner",
        description="planner: the operator's built-in planner (SLOs, P:D band, windows). hpa: a HorizontalPodAutoscaler "
        "the operator renders on the role's workload (metric below). external: another controller (KEDA, your HPA) "
        "owns the workload's replicas; the operator only reports.",
    )
    min_replicas: int = Field(1, ge=1, le=1024, description="Fewest pods (decode: groups).")
    max_replicas: int = Field(8, ge=1, le=1024, description="Most pods (decode: groups).")
    metric: HPAMetric | None = Field(None, description="The HPA's metric (driver hpa only).")

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="self.minReplicas <= self.maxReplicas",
            message="minReplicas must not exceed maxReplicas",
            holds=lambda r: r.min_replicas <= r.max_replicas,
            field="minReplicas",
        ),
        Rule(
            cel="(self.driver == 'hpa') == has(self.metric)",
            message="metric is required with driver hpa and only meaningful with it",
            holds=lambda r: (r.driver == "hpa") == (r.metric is not None),
            field="metric",
        ),
    )


class AutoscalingSLO(Model):
    """Latency targets of the built-in planner, on the routers' measured TTFT and TPOT."""

    ttft_ms: int | None = Field(None, ge=1, le=3_600_000, description="Time to first token at the percentile, ms.")
    tpot_ms: int | None = Field(None, ge=1, le=600_000, description="Time per output token at the percentile, ms.")
    percentile: Literal[50, 90, 99] = Field(90, description="Which percentile of requests must meet the targets.")


class RatioBand(Model):
    """Allowed prefill replicas per decode group (P:D), as Kthena's ratio constraint."""

    min_prefill_per_decode: float | None = Field(None, gt=0, le=1024, description="Lowest P/D.")
    max_prefill_per_decode: float | None = Field(None, gt=0, le=1024, description="Highest P/D.")

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="!has(self.minPrefillPerDecode) || !has(self.maxPrefillPerDecode) || "
            "self.minPrefillPerDecode <= self.maxPrefillPerDecode",
            message="minPrefillPerDecode must not exceed maxPrefillPerDecode",
            holds=lambda b: (
                b.min_prefill_per_decode is None
                or b.max_prefill_per_decode is None
                or b.min_prefill_per_decode <= b.max_prefill_per_decode
            ),
            field="minPrefillPerDecode",
        ),
    )


PLANNER_MODELS = ("smollm2-135m", "llama-7b")  # planner.model_shape.BUILTIN (test_autoscale checks)
PLANNER_PROFILES = ("ascend-910b", "cpu-reference")  # planner/profiles/*.yaml (test_autoscale checks)


class AutoscalingSpec(Model):
    """Per-role autoscaling and the built-in planner's targets (docs: README, Autoscaling)."""

    prefill: RoleAutoscaling = Field(default_factory=RoleAutoscaling, description="Prefill role.")
    decode: RoleAutoscaling = Field(default_factory=RoleAutoscaling, description="Decode role (groups).")
    slo: AutoscalingSLO = Field(default_factory=AutoscalingSLO, description="The planner's latency targets.")
    ratio: RatioBand = Field(default_factory=RatioBand, description="The planner's P:D band.")
    scale_up_window_seconds: int = Field(
        30, ge=0, le=3600, description="A role goes up to the lowest recommendation of this window (0: at once)."
    )
    scale_down_window_seconds: int = Field(
        300, ge=0, le=86400, description="A role goes down only to the highest recommendation of this window."
    )
    interval_seconds: int = Field(15, ge=1, le=3600, description="How often the planner looks.")
    planner_model: Literal["smollm2-135m", "llama-7b"] | None = Field(
        None,
        description="The model shape the planner's performance model uses; default: the built-in model served "
        "(required for a model from a claim or a path).",
    )
    hardware_profile: Literal["ascend-910b", "cpu-reference"] | None = Field(
        None,
        description="The planner's hardware profile; default ascend-910b on npu, cpu-reference on cpu.",
    )
    expected_prompt_tokens: int = Field(
        512, ge=1, le=1_048_576, description="Prompt length the planner assumes until routers report traffic."
    )
    expected_output_tokens: int = Field(
        128, ge=1, le=1_048_576, description="Output length the planner assumes until routers report traffic."
    )

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="!((self.prefill.enabled && self.prefill.driver == 'planner') || "
            "(self.decode.enabled && self.decode.driver == 'planner')) || has(self.slo.ttftMs) || has(self.slo.tpotMs)",
            message="the planner needs slo.ttftMs or slo.tpotMs",
            holds=lambda a: not planner_drives(a) or a.slo.ttft_ms is not None or a.slo.tpot_ms is not None,
            field="slo",
        ),
    )


def planner_drives(a: AutoscalingSpec | None, role: str | None = None) -> bool:
    """Does the built-in planner drive `role` (any role when None)?"""
    if a is None:
        return False
    roles = (role,) if role else ("prefill", "decode")
    return any(getattr(a, r).enabled and getattr(a, r).driver == "planner" for r in roles)
