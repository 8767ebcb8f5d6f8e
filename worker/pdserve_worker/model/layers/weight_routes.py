"""Which route each weight matrix takes (`--weights`): dequantized, int8 or int4. Pure functions.

The engine multiplies five kinds of matrices: per layer the fused Q/K/V, the attention output,
the fused gate/up and the down projection, and once the LM head; one route per matrix group
(the parts of a fused group share it).
- `dequantized`: float weights in the model dtype (`matmul.route`).
- `int4` / `int8`: blocks of 32 on the native block kernel (`matmul.BlockMatrix`), or torch's
  CPU int4 kernel where it is not built (`matmul.Int4Matrix`; 8-bit as two 4-bit planes), from
  the checkpoint's quantized blocks where it has them (int4 requantizes Q8_0 to 4 bits; int8
  holds 4-bit blocks exactly), else float weights quantized by llama.cpp's reference rounding.
- `auto`: what the checkpoint holds: all GGUF 4-bit parts run int4; all quantized with some
  Q8_0 run int8; anything else (float, K-quants and other types) runs dequantized.
Quantized routes run on the CPU only: `auto` on an accelerator is dequantized, an explicit
`int4`/`int8` there is refused.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from math import prod
from typing import Literal

from pdserve_common.kv_layout import DTYPE_SIZES
from pdserve_worker.model.config import ModelConfig
from pdserve_worker.model.layers.quant_blocks import GROUP
from pdserve_worker.model.shapes import weight_shapes

Kind = Literal["q4", "q8"]

WEIGHTS = ("auto", "dequantized", "int8", "int4")
ROUTES = ("dequantized", "int8", "int4")

# group name -> HF parameter names (under `model.layers.{i}.`) of its parts, in fused row order.
LAYER_GROUPS: dict[str, tuple[str, ...]] = {
    "attn_qkv": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "attn_o": ("self_attn.o_proj.weight",),
    "mlp_gate_up": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp_down": ("mlp.down_proj.weight",),
}


def head_source(config: ModelConfig) -> str:
    """The tensor the LM head multiplies by: the embedding when tied."""
    return "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"


def groups(config: ModelConfig, layers: Iterable[int]) -> dict[str, tuple[str, ...]]:
    """Every matrix group a member holding `layers` multiplies: `model.layers.{i}.{group}` and `lm_head`."""
    out = {"lm_head": (head_source(config),)}
    for layer in layers:
        p = f"model.layers.{layer}."
        for group, parts in LAYER_GROUPS.items():
            out[p + group] = tuple(p + part for part in parts)
    return out


def check_weights_choice(weights: str, device_type: str) -> None:
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    if weights in ("int4", "int8") and device_type != "cpu":
        raise ValueError(
            f"--weights {weights} runs on the CPU only (torch's weight-only {weights} kernels are CPU "
            f"kernels); on {device_type} use --weights dequantized or auto"
        )


def group_route(weights: str, kinds: list[Kind | None], device_type: str = "cpu") -> str:
    """The route of one group whose parts are stored as `kinds` (None: float)."""
    check_weights_choice(weights, device_type)
    if weights == "dequantized" or device_type != "cpu":
        return "dequantized"
    if weights != "auto":
        return weights
    if kinds and all(k == "q4" for k in kinds):
        return "int4"
    if kinds and all(k is not None for k in kinds):
        return "int8"
    return "dequantized"


def plan(
    config: ModelConfig, weights: str, stored: Mapping[str, Kind], layers: Iterable[int], device_type: str = "cpu"
) -> dict[str, str]:
    """Route per matrix group of `layers` (and the LM head); `stored` gives the quantized kind of
    each tensor the checkpoint holds quantized."""
    return {
        group: group_route(weights, [stored.get(n) for n in parts], device_type)
        for group, parts in groups(config, layers).items()
    }


def summary(routes: Mapping[str, str]) -> dict[str, str]:
    """Route per layer type (`attn_qkv`, ..., `lm_head`); a type whose layers differ lists the counts."""
    by_type: dict[str, Counter[str]] = {}
    for group, route in routes.items():
        by_type.setdefault(group.rsplit(".", 1)[-1], Counter())[route] += 1
    return {
        kind: next(iter(c)) if len(c) == 1 else ", ".join(f"{r} ({n} layers)" for r, n in sorted(c.items()))
        for kind, c in by_type.items()
    }


def matrix_bytes(shape: tuple[int, int], route: str, dtype: str) -> int:
    """Bytes a `[rows, cols]` matrix takes on `route`, on whichever kernel holds it (the larger):
    the native one (matmul.pack_native: per value half a byte for int4, a byte for int8, plus an
    fp16 scale and minimum per 32, rows padded to 32) or torch's (matmul.pack_int4: per 4-bit
    plane, int4 one and int8 two, half a byte per value plus a bf16 scale and zero per 32, rows
    padded to 16). A worker takes torch's where the native ops are not built."""
    rows, cols = shape
    if route in ("int4", "int8"):
        groups = cols // GROUP
        planes, padded = (1 if route == "int4" else 2), rows + (-rows % 16)
        torch_bytes = planes * (padded * cols // 2 + groups * padded * 2 * 2)
        padded = rows + (-rows % 32)
        native_bytes = padded * (cols // 2 if route == "int4" else cols) + groups * padded * 2 * 2
        return max(torch_bytes, native_bytes)
    return rows * cols * DTYPE_SIZES[dtype]


def loaded_weight_bytes(
    config: ModelConfig, dtype: str, routes: Mapping[str, str], layers: Iterable[int], tied_copy: bool
) -> int:
    """Bytes of every weight a member holding `layers` keeps on the planned `routes`.

    `tied_copy`: the LM head is held apart from the embedding rows (a tied model on the CPU,
    or any quantized head), so a tied embedding counts twice, once per form."""
    layers = list(layers)
    shapes = weight_shapes(config, layers)
    in_groups: set[str] = set()
    total = 0
    for group, parts in groups(config, layers).items():
        route = routes.get(group, "dequantized")
        for name in parts:
            if group == "lm_head" and config.tie_word_embeddings:
                if tied_copy or route != "dequantized":
                    total += matrix_bytes(shapes[name], route, dtype)
                continue  # the embedding itself is counted below
            total += matrix_bytes(shapes[name], route, dtype)
            in_groups.add(name)
    for name, shape in shapes.items():
        if name not in in_groups:
            total += prod(shape) * DTYPE_SIZES[dtype]
    return total
