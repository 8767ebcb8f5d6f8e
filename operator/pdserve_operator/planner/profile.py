"""A hardware profile: what one replica's device does per second, and its fixed costs.

Either measured on a machine (`pdserve plan --profile` writes one: then the efficiencies are 1,
because the figures are what torch achieved there) or published (a datasheet's peak figures,
with the efficiency assumed for serving stated separately, so both stay visible). A YAML or
JSON file; `sources` says where every number comes from.

Overheads are the engine's fixed costs that no roofline shows (kernel dispatch, Python): per
forward pass, per layer, per sequence per layer in a decode batch, and per request on the
road router → decode → prefill → notify. A measured profile takes them from a tiny-width model
on the same engine (all overhead, no arithmetic), never from serving results.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

from pdserve_operator.planner.model_shape import DTYPE_BYTES

PROFILES_DIR = Path(__file__).parent / "profiles"


class HardwareProfile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    device: Literal["cpu", "npu", "cuda"]
    dtype: Literal["float32", "bfloat16", "float16"] = Field(description="serving dtype of weights and KV")
    matmul_flops: float = Field(gt=0, description="dense GEMM FLOP/s in `dtype` (prefill shapes)")
    attention_flops: float | None = Field(default=None, gt=0, description="causal attention FLOP/s; None: matmul_flops")
    attention_overhead_s: float = Field(default=0.0, ge=0, description="fixed cost of one layer's prefill attention")
    memory_bandwidth: float = Field(gt=0, description="bytes/s a decode step streams (weights + KV)")
    compute_efficiency: float = Field(default=1.0, gt=0, le=1, description="share of matmul/attention FLOP/s achieved")
    memory_efficiency: float = Field(default=1.0, gt=0, le=1, description="share of memory_bandwidth achieved")
    link_bandwidth: float = Field(gt=0, description="bytes/s of the KV push between a prefill and a decode")
    link_latency_s: float = Field(default=0.0, ge=0, description="one round trip on the link")
    collective_bandwidth: float | None = Field(
        default=None,
        gt=0,
        description="bytes/s of an all_reduce's ring between the devices of a tensor-parallel instance; None: link_bandwidth",
    )
    collective_latency_s: float | None = Field(
        default=None, ge=0, description="fixed cost of one all_reduce; None: link_latency_s"
    )
    step_overhead_s: float = Field(default=0.0, ge=0, description="fixed cost of one forward pass")
    layer_overhead_s: float = Field(default=0.0, ge=0, description="fixed cost per layer per forward pass")
    sequence_overhead_s: float = Field(default=0.0, ge=0, description="per sequence per layer in a decode step")
    request_overhead_s: float = Field(default=0.0, ge=0, description="per request: routing, RPCs, ready notify")
    overlap_compute_memory: bool = Field(
        default=True, description="roofline max(compute, memory) per pass (accelerators); False: their sum (CPU)"
    )
    overlap_transfer: bool = Field(
        default=True, description="KV push runs beside compute (DMA), only the last chunk shows; False: after it"
    )
    memory_capacity_bytes: float | None = Field(default=None, gt=0, description="device memory; None: not a limit")
    memory_utilization: float = Field(default=0.9, gt=0, le=1, description="share of it for weights + KV")
    sources: list[str] = Field(default_factory=list)
    measured: dict[str, Any] | None = None

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def effective_matmul_flops(self) -> float:
        return self.matmul_flops * self.compute_efficiency

    @property
    def effective_attention_flops(self) -> float:
        return (self.attention_flops or self.matmul_flops) * self.compute_efficiency

    @property
    def effective_memory_bandwidth(self) -> float:
        return self.memory_bandwidth * self.memory_efficiency

    def with_overrides(self, **changes: Any) -> HardwareProfile:
        """A copy with fields changed, validated again (frozen models copy without checks)."""
        return HardwareProfile.model_validate({**self.model_dump(), **changes})

    def dump(self, path: str | Path) -> None:
        """Write as JSON (`.json`) or YAML (anything else)."""
        path = Path(path)
        data = self.model_dump(mode="json", exclude_none=True)
        text = json.dumps(data, indent=2) + "\n" if path.suffix == ".json" else yaml.safe_dump(data, sort_keys=False)
        path.write_text(text)


def load_profile(ref: str | Path) -> HardwareProfile:
    """A bundled profile's name (`bundled_names()`) or a YAML/JSON file."""
    if str(ref) in bundled_names():
        return bundled_profile(str(ref))
    path = Path(ref)
    if not path.is_file():
        raise ValueError(f"profile {str(ref)!r} is neither a bundled profile ({', '.join(bundled_names())}) nor a file")
    data = yaml.safe_load(path.read_text())  # YAML is a superset of JSON
    if not isinstance(data, dict):
        raise ValueError(f"profile {path} must hold a mapping, got {type(data).__name__}")
    return HardwareProfile.model_validate(data)


def bundled_names() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))


def bundled_profile(name: str) -> HardwareProfile:
    path = PROFILES_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"no bundled profile {name!r}; bundled: {', '.join(bundled_names())}")
    return HardwareProfile.model_validate(yaml.safe_load(path.read_text()))
