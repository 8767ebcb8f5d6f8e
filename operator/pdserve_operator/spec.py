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
    def _check_rules(self) -> "Model":
        broken = [rule.message for rule in type(self).rules if not rule.holds(self)]
        if broken:  # every broken rule at once, as the API server reports every CEL failure
            raise ValueError("; ".join(broken))
        return self

    def wire(self) -> dict[str, Any]:
        """The JSON form Kubernetes stores: camelCase, unset optionals left out."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


_QUANTITY = re.compile(
    r"^[+-]?(\d+(\.\d*)?|\.\d+)(([KMGTPE]i)|[numkMGTPE]|([eE][+-]?(\d+(\.\d*)?|\.\d+)))?$"
)


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
    limits: dict[str, Quantity] = Field(
        default_factory=dict, description="Maximum resources the container may use."
    )


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
        "SmolLM2-135M-Instruct", min_length=1, max_length=253, description="Model name reported by the API (/v1/models)."
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
    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16", description="Compute and KV cache dtype."
    )
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
    def _known_builtin(self) -> "ModelSpec":
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
        4, ge=1, le=1024, description="Layers computed between two KV pushes (transfer of chunk k overlaps compute of k+1)."
    )


class DecodeSpec(PodOverrides):
    """Decode workers: own the KV pool, wait for readiness, generate tokens."""

    replicas: int = Field(
        1, ge=0, le=1024, description="Number of decode groups (the scale subresource; kubectl scale pdis/NAME)."
    )
    slots: int = Field(8, ge=1, le=4096, description="Request slots in each decode group's KV pool.")
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
    )


class TransferSpec(Model):
    """How KV moves from prefill to decode."""

    backend: Literal["hixl", "cpu", "auto"] = Field(
        "auto", description="hixl (CANN one-sided transfer, NPU only), cpu (host-memory engine), auto (hixl where available)."
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


class RouterSpec(PodOverrides):
    """Routers: the OpenAI-compatible HTTP front."""

    replicas: int = Field(1, ge=0, le=1024, description="Number of router pods.")
    service: RouterServiceSpec = Field(default_factory=RouterServiceSpec, description="The router Service.")


class TLSSpec(Model):
    """TLS for the service's own hops, from a Secret in its namespace (cert-manager's shape)."""

    secret_name: str = Field(
        min_length=1, max_length=253, pattern=DNS_SUBDOMAIN,
        description=(
            "Secret with tls.crt, tls.key and ca.crt (what a cert-manager Certificate writes). Every pod "
            "mounts it: gRPC between the service's pods is mutual TLS only, the router serves HTTPS. The "
            "certificate needs both server and client auth usages and the name in serverName."
        ),
    )
    server_name: str | None = Field(
        None, min_length=1, max_length=253, pattern=DNS_SUBDOMAIN,
        description=(
            "The DNS name the certificate carries that peers check (pods dial each other by IP); "
            "default NAME.NAMESPACE.svc, the router Service's name."
        ),
    )


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

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="self.transfer.backend != 'hixl' || self.device.type == 'npu'",
            message="transfer.backend hixl needs device.type npu",
            holds=lambda s: s.transfer.backend != "hixl" or s.device.type == "npu",
            field="transfer.backend",
        ),
    )

    @model_validator(mode="after")
    def _fits_builtin_model(self) -> "PDInferenceServiceSpec":
        """Checks the API server cannot make: it does not know a built-in model's depth."""
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


class PDInferenceServiceStatus(Model):
    """Observed state, written by the operator only."""

    phase: Phase = Field("Pending", description="Pending, Progressing, Ready, Degraded or Invalid.")
    observed_generation: int = Field(0, ge=0, description="The spec generation this status describes.")
    conditions: list[Condition] = Field(default_factory=list, description="Ready, Progressing, Degraded, SpecValid.")
    prefill: RoleStatus = Field(default_factory=RoleStatus, description="Prefill pods.")
    decode: DecodeStatus = Field(default_factory=DecodeStatus, description="Decode groups.")
    router: RoleStatus = Field(default_factory=RoleStatus, description="Router pods.")
    slots: SlotStatus = Field(default_factory=SlotStatus, description="KV slot usage.")
    endpoint: str = Field("", description="In-cluster URL of the OpenAI-compatible API.")

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
