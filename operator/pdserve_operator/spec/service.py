"""PDInferenceService spec and status: the single source of truth for the custom resource.

The CRD's OpenAPI schema is generated from these models (`crd.py`), and the operator validates
every resource with them before reconciling. Cross-field rules are written once as `Rule`s:
each carries the CEL expression the API server enforces (`x-kubernetes-validations`) and the
Python predicate the operator enforces, side by side, so the two cannot drift apart unseen
(`tests/unit/test_operator_spec_crd.py` evaluates both on the same inputs).

Some checks cannot live in the schema because they need knowledge the API server lacks (the
layer count of a built-in model); they are plain validators here, and a resource failing them
gets `SpecValid=False` in its status instead of children.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema, model_validator
from pydantic.alias_generators import to_camel

GROUP = "pdserve.dev"
VERSION = "v1alpha1"
KIND = "PDInferenceService"
PLURAL = "pdinferenceservices"
SINGULAR = "pdinferenceservice"
SHORT_NAMES = ("pdis",)
API_VERSION = f"{GROUP}/{VERSION}"

# A resource's name prefixes every child (`NAME-decode-headless` is the longest, and StatefulSet
# pod names carry a revision hash label limited to 63 characters), so names are kept short.
MAX_NAME_LENGTH = 40


@dataclass(frozen=True)
class BuiltinModel:
    """A model the worker image ships (the operator only needs what it validates against)."""

    name: str
    layers: int


# Models selectable as `source: builtin:<key>`; must match what the worker image bundles.
BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2": BuiltinModel(name="SmolLM2-135M-Instruct", layers=30),
}


@dataclass(frozen=True)
class Rule:
    """A cross-field rule, enforced by the API server (CEL) and by the operator (Python).

    `field` is the path relative to the model the rule sits on, used in error messages.
    """

    cel: str
    message: str
    holds: Callable[[Any], bool]
    field: str = ""

    def schema(self) -> dict[str, str]:
        out = {"rule": self.cel, "message": self.message}
        if self.field:
            out["fieldPath"] = "." + self.field
        return out


def _schema_rules(schema: dict[str, Any], cls: type) -> None:
    """Publish a model's `Rule`s as CEL in its JSON schema (read by crd.py)."""
    rules = cls.__dict__.get("rules", ())
    if rules:
        schema["x-kubernetes-validations"] = [r.schema() for r in rules]


class Model(BaseModel):
    """Base: camelCase on the wire, unknown fields rejected, `Rule`s checked after parsing."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        json_schema_extra=_schema_rules,
    )
    rules: ClassVar[tuple[Rule, ...]] = ()

    @model_validator(mode="after")
    def _check_rules(self) -> Model:
        broken = [rule.message for rule in type(self).rules if not rule.holds(self)]
        if broken:  # every broken rule at once, as the API server reports every CEL failure
            raise ValueError("; ".join(broken))
        return self

    def wire(self) -> dict[str, Any]:
        """The JSON form Kubernetes stores: camelCase, unset optionals left out."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


_QUANTITY = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)(([KMGTPE]i)|[numkMGTPE]|([eE][+-]?(\d+(\.\d*)?|\.\d+)))?$")


def _check_quantity(value: int | str) -> int | str:
    if isinstance(value, str) and not _QUANTITY.match(value):
        raise ValueError(f"not a Kubernetes quantity: {value!r} (e.g. 500m, 2Gi, 1)")
    return value


Quantity = Annotated[
    int | str,
    AfterValidator(_check_quantity),
    WithJsonSchema(
        {
            "x-kubernetes-int-or-string": True,
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": _QUANTITY.pattern,
            "description": "A Kubernetes quantity such as 500m, 2Gi or 1.",
        }
    ),
]

DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


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


class ModelSpec(Model):
    """Which model to serve and how."""

    name: str = Field(
        "SmolLM2-135M-Instruct",
        min_length=1,
        max_length=253,
        description="Model name reported by the API (/v1/models).",
    )
    source: str = Field(
        "builtin:smollm2",
        pattern=r"^(builtin:[a-z0-9][a-z0-9-]*|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/[^/].*)?|/.+)$",
        max_length=1024,
        description=(
            "Where the weights are: builtin:NAME (shipped in the image), pvc://CLAIM[/SUBPATH] "
            "(a PersistentVolumeClaim mounted read-only at /models), or an absolute path inside the pod."
        ),
    )
    dtype: Literal["bfloat16", "float16", "float32"] = Field("bfloat16", description="Compute and KV cache dtype.")
    max_length: int = Field(
        2048, ge=16, le=1_048_576, description="Maximum tokens per request (prompt plus output); sizes each KV slot."
    )

    @property
    def builtin(self) -> BuiltinModel | None:
        """The built-in model named by `source`, if it names one (unknown names fail validation)."""
        if not self.source.startswith("builtin:"):
            return None
        return BUILTIN_MODELS.get(self.source.removeprefix("builtin:"))

    @model_validator(mode="after")
    def _known_builtin(self) -> ModelSpec:
        if self.source.startswith("builtin:") and self.builtin is None:
            raise ValueError(
                f"model.source: unknown built-in model {self.source!r}; known: "
                + ", ".join(f"builtin:{k}" for k in sorted(BUILTIN_MODELS))
            )
        return self


class DeviceSpec(Model):
    """The accelerator each prefill and decode pod requests."""

    type: Literal["npu", "cuda", "cpu"] = Field("cpu", description="Accelerator kind.")
    resource_name: str | None = Field(
        None,
        pattern=r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[a-zA-Z0-9]([-a-zA-Z0-9._]*[a-zA-Z0-9])?$",
        max_length=253,
        description="Extended resource to request, e.g. huawei.com/Ascend910 or nvidia.com/gpu. Required for npu and cuda.",
    )
    count: int = Field(1, ge=0, le=64, description="Accelerators per pod (ignored for cpu).")

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="self.type == 'cpu' || has(self.resourceName)",
            message="resourceName is required when type is npu or cuda",
            holds=lambda d: d.type == "cpu" or d.resource_name is not None,
            field="resourceName",
        ),
        Rule(
            cel="self.type == 'cpu' || self.count >= 1",
            message="count must be at least 1 when type is npu or cuda",
            holds=lambda d: d.type == "cpu" or d.count >= 1,
            field="count",
        ),
    )


class PrefillSpec(PodOverrides):
    """Prefill workers: compute a prompt's KV and push it into a decode slot."""

    replicas: int = Field(1, ge=0, le=1024, description="Number of prefill pods.")
    layers_per_chunk: int = Field(
        4,
        ge=1,
        le=1024,
        description="Layers computed between two KV pushes (transfer of chunk k overlaps compute of k+1).",
    )
    prefix_cache_tokens: int | None = Field(
        None,
        ge=0,
        le=16_777_216,
        description="Tokens of prompt-prefix KV each prefill pod keeps for reuse (blocks of 16 tokens, LRU): a prompt "
        "whose beginning was seen computes only the rest; a prompt reuses only its own tenant's prefixes. Unset: "
        "a quarter of the pod's memory limit (the worker sizes it at start and logs it). 0: no prefix cache.",
    )
    prefix_disk_gib: int | None = Field(
        None,
        ge=1,
        le=65_536,
        description="A second tier for the prefix cache on the pod's disk: an emptyDir of this many GiB (kept across "
        "container restarts, not across pod deletion) holding every cached block, read back on a hit, checked, LRU. "
        "Unset: RAM only.",
    )


class DecodeSpec(PodOverrides):
    """Decode workers: own the KV pool, wait for readiness, generate tokens."""

    replicas: int = Field(
        1, ge=0, le=1024, description="Number of decode groups (the scale subresource; kubectl scale pdis/NAME)."
    )
    slots: int = Field(
        8,
        ge=1,
        le=4096,
        description="Concurrent requests per decode group. With kvBlockTokens 0 also its KV pool: slots of "
        "model.maxLength tokens each.",
    )
    kv_block_tokens: int = Field(
        16,
        ge=0,
        le=4096,
        description="Tokens per KV block: a request reserves blocks for its prompt plus max_tokens, so capacity is "
        "counted in tokens. 0: one model.maxLength slot per request. A layer-sharded group (layerShards > 1) keeps "
        "slots.",
    )
    kv_tokens: int | None = Field(
        None,
        ge=1,
        le=1 << 30,
        description="KV pool size in tokens per decode group with blocks (default slots x model.maxLength: the "
        "memory of the slots, capped by the decode at half its pod's memory limit and logged at start).",
    )
    readiness: Literal["interrupt", "poll", "spin"] = Field(
        "interrupt",
        description="How decode waits for a slot's KV: interrupt (block on the notification), poll (every pollIntervalMicros), spin.",
    )
    poll_interval_micros: int | None = Field(
        None, ge=1, le=1_000_000, description="Poll period with readiness poll (default 100)."
    )
    warmup: bool = Field(
        True,
        description="Touch a slot's KV pages before its first decode step, so it takes no page faults "
        "(device cpu; a no-op elsewhere).",
    )
    layer_shards: int = Field(
        1,
        ge=1,
        le=64,
        description="Pods per decode group, each holding a contiguous share of the layers; the StatefulSet runs replicas x layerShards pods.",
    )
    drain_timeout_seconds: int = Field(
        60, ge=0, le=3600, description="How long a stopping decode pod may finish its requests (preStop /drain)."
    )

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="!has(self.pollIntervalMicros) || self.readiness == 'poll'",
            message="pollIntervalMicros is only meaningful with readiness poll",
            holds=lambda d: d.poll_interval_micros is None or d.readiness == "poll",
            field="pollIntervalMicros",
        ),
        Rule(
            cel="!has(self.kvTokens) || self.kvBlockTokens > 0",
            message="kvTokens is only meaningful with kvBlockTokens > 0 (max-length slots hold slots x maxLength)",
            holds=lambda d: d.kv_tokens is None or d.kv_block_tokens > 0,
            field="kvTokens",
        ),
    )


class TransferSpec(Model):
    """How KV moves from prefill to decode."""

    backend: Literal["hixl", "cpu", "auto"] = Field(
        "auto",
        description="hixl (CANN one-sided transfer, NPU only), cpu (host-memory engine), auto (hixl where available).",
    )
    queue_depth: int = Field(
        8,
        ge=1,
        le=1024,
        description="KV puts (one per layer and K/V) a prefill keeps in flight to each decode pod; past it, it waits "
        "for completions before putting more.",
    )
    connect_timeout_ms: int = Field(5000, ge=1, le=600_000, description="Timeout to connect to a decode engine.")
    transfer_timeout_ms: int = Field(
        30000,
        ge=1,
        le=3_600_000,
        description="Deadline of each KV put (and of retrying a full engine queue or the ready notification); a put "
        "that misses it aborts the push and disconnects that decode pod. Decode keeps an abandoned slot "
        "quarantined for this long plus 5 s, so no late write lands in a reused slot.",
    )
    engine_options: dict[str, str] = Field(
        default_factory=dict, description="Options passed verbatim to the transfer engine's initialize."
    )


class RouterServiceSpec(Model):
    """The Service in front of the routers."""

    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = Field("ClusterIP", description="Service type.")
    port: int = Field(8000, ge=1, le=65535, description="Service port of the OpenAI-compatible API.")
    node_port: int | None = Field(None, ge=30000, le=32767, description="Fixed node port (NodePort or LoadBalancer).")

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="!has(self.nodePort) || self.type != 'ClusterIP'",
            message="nodePort needs type NodePort or LoadBalancer",
            holds=lambda s: s.node_port is None or s.type != "ClusterIP",
            field="nodePort",
        ),
    )


class RouterAuthSpec(Model):
    """API keys on the OpenAI endpoint (docs/admission.md)."""

    secret_name: str = Field(
        min_length=1,
        max_length=253,
        pattern=DNS_SUBDOMAIN,
        description=(
            "Secret whose keys.yaml lists the tenants, their keys (or their SHA-256 digests) and optional "
            "limits: requestsPerMinute, tokensPerMinute, maxConcurrent, maxPriority, weight. Requests need "
            "'Authorization: Bearer KEY' (401 otherwise). Routers re-read it when it changes: rotating a "
            "key needs no restart."
        ),
    )


class RouterAdmissionSpec(Model):
    """The routers' admission queue: requests wait here for a KV reservation (docs/admission.md)."""

    queue_size: int = Field(
        1024,
        ge=1,
        le=1_000_000,
        description="Requests that may wait per router; past it, 429 with Retry-After from the measured drain rate.",
    )
    per_tenant: int = Field(256, ge=1, le=1_000_000, description="Of those, how many one tenant may hold.")
    deadline_seconds: int = Field(
        60,
        ge=1,
        le=86_400,
        description=(
            "Longest a request waits for admission; a request may shorten it with the x-pdserve-deadline-ms "
            "header. One the measured drain rate cannot admit in time is answered 429 at once."
        ),
    )


class RouterSpec(PodOverrides):
    """Routers: the OpenAI-compatible HTTP front."""

    replicas: int = Field(1, ge=0, le=1024, description="Number of router pods.")
    service: RouterServiceSpec = Field(default_factory=RouterServiceSpec, description="The router Service.")
    auth: RouterAuthSpec | None = Field(None, description="API keys (no authentication when unset).")
    admission: RouterAdmissionSpec = Field(
        default_factory=RouterAdmissionSpec,
        description="Admission queue; each tenant's limits are shared out among the router replicas.",
    )


class TLSSpec(Model):
    """TLS for the service's own hops, from a Secret in its namespace (cert-manager's shape)."""

    secret_name: str = Field(
        min_length=1,
        max_length=253,
        pattern=DNS_SUBDOMAIN,
        description=(
            "Secret with tls.crt, tls.key and ca.crt (what a cert-manager Certificate writes). Every pod "
            "mounts it: gRPC between the service's pods is mutual TLS only, the router serves HTTPS. The "
            "certificate needs both server and client auth usages and the name in serverName."
        ),
    )
    server_name: str | None = Field(
        None,
        min_length=1,
        max_length=253,
        pattern=DNS_SUBDOMAIN,
        description=(
            "The DNS name the certificate carries that peers check (pods dial each other by IP); "
            "default NAME.NAMESPACE.svc, the router Service's name."
        ),
    )


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


class TracingSpec(Model):
    """OpenTelemetry tracing of requests across router, prefill and decode (common/pdserve_common/tracing.py)."""

    endpoint: str = Field(
        min_length=1,
        max_length=2048,
        pattern=r"^https?://[^\s]+$",
        description="OTLP/gRPC endpoint of an OpenTelemetry collector, e.g. http://otel-collector.observability:4317.",
    )
    sample_ratio: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description="Fraction of requests traced, decided at the router by trace id (a client's traceparent "
        "links the trace but cannot force it to be recorded); prefill and decode follow the router's decision.",
    )


class ObservabilitySpec(Model):
    """What the service reports besides its metrics."""

    tracing: TracingSpec | None = Field(None, description="Request tracing (off when unset).")


class PDInferenceServiceSpec(Model):
    """Desired state of a prefill/decode disaggregated inference service."""

    model: ModelSpec = Field(default_factory=ModelSpec, description="The model to serve.")
    image: str | None = Field(
        None, min_length=1, max_length=1024, description="Worker image; the operator's default when unset."
    )
    device: DeviceSpec = Field(default_factory=DeviceSpec, description="Accelerator per prefill/decode pod.")
    prefill: PrefillSpec = Field(default_factory=PrefillSpec, description="Prefill role.")
    decode: DecodeSpec = Field(default_factory=DecodeSpec, description="Decode role.")
    transfer: TransferSpec = Field(default_factory=TransferSpec, description="KV transfer settings.")
    router: RouterSpec = Field(default_factory=RouterSpec, description="Router role and its Service.")
    tls: TLSSpec | None = Field(None, description="TLS on the service's gRPC hops and its API (off when unset).")
    autoscaling: AutoscalingSpec | None = Field(
        None,
        description="Per-role autoscaling (off when unset): the built-in planner, a rendered HPA, or another "
        "controller owns a role's replicas.",
    )
    observability: ObservabilitySpec = Field(
        default_factory=ObservabilitySpec, description="Tracing (the metrics are always on)."
    )

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="self.transfer.backend != 'hixl' || self.device.type == 'npu'",
            message="transfer.backend hixl needs device.type npu",
            holds=lambda s: s.transfer.backend != "hixl" or s.device.type == "npu",
            field="transfer.backend",
        ),
        Rule(
            cel="!has(self.autoscaling) || !self.autoscaling.prefill.enabled || "
            "self.prefill.replicas <= self.autoscaling.prefill.maxReplicas",
            message="prefill.replicas (the floor while autoscaling) must not exceed autoscaling.prefill.maxReplicas",
            holds=lambda s: (
                s.autoscaling is None
                or not s.autoscaling.prefill.enabled
                or s.prefill.replicas <= s.autoscaling.prefill.max_replicas
            ),
            field="prefill.replicas",
        ),
        Rule(
            cel="!has(self.autoscaling) || !self.autoscaling.decode.enabled || "
            "self.decode.replicas <= self.autoscaling.decode.maxReplicas",
            message="decode.replicas (the floor while autoscaling) must not exceed autoscaling.decode.maxReplicas",
            holds=lambda s: (
                s.autoscaling is None
                or not s.autoscaling.decode.enabled
                or s.decode.replicas <= s.autoscaling.decode.max_replicas
            ),
            field="decode.replicas",
        ),
        Rule(
            cel="!has(self.autoscaling) || !self.autoscaling.decode.enabled || self.autoscaling.decode.driver == 'planner' "
            "|| self.decode.layerShards == 1",
            message="with decode.layerShards > 1 only the planner scales decode (an HPA counts pods, not groups)",
            holds=lambda s: (
                s.autoscaling is None
                or not s.autoscaling.decode.enabled
                or s.autoscaling.decode.driver == "planner"
                or s.decode.layer_shards == 1
            ),
            field="autoscaling.decode.driver",
        ),
    )

    @model_validator(mode="after")
    def _fits_builtin_model(self) -> PDInferenceServiceSpec:
        """Checks the API server cannot make: it does not know a built-in model's depth."""
        if planner_drives(self.autoscaling) and planner_model_name(self) is None:
            raise ValueError(
                "autoscaling.plannerModel: the planner needs the shape of a model from "
                f"{self.model.source!r}; name one of {', '.join(PLANNER_MODELS)}"
            )
        builtin = self.model.builtin
        if builtin is None:
            return self
        if self.decode.layer_shards > builtin.layers:
            raise ValueError(
                f"decode.layerShards: {self.decode.layer_shards} shards exceed the "
                f"{builtin.layers} layers of {self.model.source}"
            )
        if self.prefill.layers_per_chunk > builtin.layers:
            raise ValueError(
                f"prefill.layersPerChunk: {self.prefill.layers_per_chunk} exceeds the "
                f"{builtin.layers} layers of {self.model.source}"
            )
        return self


# Served built-in model → the planner's model shape of it.
_PLANNER_SHAPE_OF_BUILTIN = {"smollm2": "smollm2-135m"}


def planner_model_name(spec: PDInferenceServiceSpec) -> str | None:
    """The planner's model shape for a spec: named, or that of the built-in model served."""
    if spec.autoscaling is not None and spec.autoscaling.planner_model is not None:
        return spec.autoscaling.planner_model
    if spec.model.source.startswith("builtin:"):
        return _PLANNER_SHAPE_OF_BUILTIN.get(spec.model.source.removeprefix("builtin:"))
    return None


def planner_profile_name(spec: PDInferenceServiceSpec) -> str:
    if spec.autoscaling is not None and spec.autoscaling.hardware_profile is not None:
        return spec.autoscaling.hardware_profile
    return "ascend-910b" if spec.device.type == "npu" else "cpu-reference"


def autoscaled(spec: PDInferenceServiceSpec, role: str) -> bool:
    """Is `role`'s replica count an autoscaler's (then the operator writes it only at creation)?"""
    a = spec.autoscaling
    return a is not None and role in ("prefill", "decode") and getattr(a, role).enabled


def effective_min(spec: PDInferenceServiceSpec, role: str) -> int:
    """An autoscaled role's floor: max(minReplicas, the role's replicas) (decode: groups)."""
    assert spec.autoscaling is not None
    r: RoleAutoscaling = getattr(spec.autoscaling, role)
    replicas: int = getattr(spec, role).replicas
    return min(r.max_replicas, max(r.min_replicas, replicas))


# ---------------------------------------------------------------------------------------------
# Status

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


def parse_spec(spec: dict[str, Any] | None) -> PDInferenceServiceSpec:
    """Validate a resource's `.spec` (raises pydantic.ValidationError naming the fields)."""
    # Only a missing spec means "all defaults": an empty list or 0 is a malformed one.
    return PDInferenceServiceSpec.model_validate({} if spec is None else spec)


def describe(exc: ValidationError) -> str:
    """One line per problem, each naming the field as it is spelled in the resource."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(part) for part in err["loc"])
        msg = str(err["msg"]).removeprefix("Value error, ")
        lines.append(f"spec.{loc}: {msg}" if loc else f"spec: {msg}")
    return "; ".join(lines)
