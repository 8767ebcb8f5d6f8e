"""Which model is served, and on which accelerator."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from pdserve_operator.planner.model_shape import tensor_parallel_sizes
from pdserve_operator.spec.base import Model, Rule


@dataclass(frozen=True)
class BuiltinModel:
    """A model the worker image ships (the operator only needs what it validates against)."""

    name: str
    layers: int
    heads: int
    kv_heads: int

    def tensor_parallel_sizes(self) -> list[int]:
        """The sizes that split its heads (the planner's rule, the worker's `valid_sizes`)."""
        return tensor_parallel_sizes(self.heads, self.kv_heads)


# Models selectable as `source: builtin:<key>`; must match what the worker image bundles.
BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2": BuiltinModel(name="SmolLM2-135M-Instruct", layers=30, heads=9, kv_heads=3),
}


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
