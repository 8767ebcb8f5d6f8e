"""The decoder's weights as `LlamaModel` holds them: checked against the config, matrices fused
(Q/K/V, gate/up) and held as their route runs them fastest (`weight_routes.plan`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from pdserve_worker.model.config import ModelConfig
from pdserve_worker.model.layers.matmul import Linear
from pdserve_worker.model.layers.quant import QuantizedTensor, dequantize, quantize, to_kind
from pdserve_worker.model.shapes import weight_shapes


@dataclass(frozen=True)
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden]
    # The four matrices are as `Linear.prepare`/`prepare_quantized` returned them (possibly opaque
    # oneDNN tensors or `matmul.Int4Matrix`): pass them to `LlamaModel.linear`, nowhere else.
    qkv: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]
    o: torch.Tensor  # [hidden, heads * head_dim]
    mlp_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]
    qkv_bias: torch.Tensor | None = None  # [(heads + 2 * kv_heads) * head_dim]
    o_bias: torch.Tensor | None = None  # [hidden]
    # qwen3's q_norm and k_norm weights, one row per head: [heads + kv_heads, head_dim].
    qk_norm: torch.Tensor | None = None


def check_weights(
    config: ModelConfig,
    weights: Mapping[str, torch.Tensor],
    layers: range,
    quantized: Mapping[str, QuantizedTensor] | None = None,
) -> None:
    """Every tensor the config implies for `layers` is present with its shape (names the first that
    is not), as a float tensor or, for a matrix, quantized."""
    quantized = quantized or {}
    for name, shape in weight_shapes(config, layers).items():
        tensor = weights.get(name, quantized.get(name))
        if tensor is None:
            why = " (config.json tie_word_embeddings is false)" if name == "lm_head.weight" else ""
            raise ValueError(f"weight {name!r} missing from checkpoint{why}")
        if tuple(tensor.shape) != shape:
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, config.json implies {shape}")


def _hf(name: str, weights: Mapping[str, torch.Tensor]) -> torch.Tensor:
    try:
        return weights[name]
    except KeyError:
        raise KeyError(f"weight {name!r} missing from checkpoint") from None


class WeightBuilder:
    """Builds `LlamaModel`'s tensors from a checkpoint: each in the model's dtype and device,
    each matrix group as its route runs it fastest (`weight_routes.plan`)."""

    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, torch.Tensor],
        quantized: Mapping[str, QuantizedTensor],
        groups: Mapping[str, Sequence[str]],
        routes: Mapping[str, str],
        linear: Linear,
    ) -> None:
        self.config, self.weights, self.quantized = config, weights, quantized
        self.groups, self.routes, self.linear = groups, routes, linear

    def take(self, name: str) -> torch.Tensor:
        # Same dtype and device: the checkpoint's (memory-mapped) tensor itself, no copy.
        return _hf(name, self.weights).to(device=self.linear.device, dtype=self.linear.dtype).contiguous()

    def fused(self, *names: str) -> torch.Tensor:
        # One pass per part (cast and copy together) into the fused matrix: loading stays fast.
        parts = [_hf(n, self.weights) for n in names]
        rows = sum(p.shape[0] for p in parts)
        out = torch.empty((rows, *parts[0].shape[1:]), dtype=self.linear.dtype, device=self.linear.device)
        row = 0
        for part in parts:
            out[row : row + part.shape[0]].copy_(part)
            row += part.shape[0]
        return out

    def matrix(self, group: str, dense: Callable[[], torch.Tensor]) -> torch.Tensor | object:
        """A group's matrix as its route runs it fastest (a prepacked, opaque oneDNN or
        quantized matrix: for `Linear` only)."""
        route, names, quantized = self.routes[group], self.groups[group], self.quantized
        if route == "dequantized":
            return self.linear.prepare(dense())
        # The checkpoint's own blocks where it has them (int8 holds 4- and 8-bit ones exactly),
        # else the float weights quantized by llama.cpp's reference rounding.
        kind = "q4" if route == "int4" else "q8"
        parts = [
            (to_kind(quantized[n], kind) if route == "int4" else quantized[n])
            if n in quantized
            else quantize(_hf(n, self.weights), kind)
            for n in names
        ]
        return self.linear.prepare_quantized(parts, route)

    def head_rows(self, embed_tokens: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """A quantized head's exact rows (fp32, by token id), for `head`'s refinement: a tied
        head's are the embedding rows; an untied one keeps its checkpoint blocks and dequantizes rows."""
        if self.routes["lm_head"] == "dequantized":
            return None
        if self.config.tie_word_embeddings:
            return lambda ids: embed_tokens[ids].float()
        stored = self.quantized.get("lm_head.weight") or quantize(_hf("lm_head.weight", self.weights), "q8")
        return lambda ids: dequantize(stored.rows(ids.reshape(-1))).reshape(*ids.shape, -1)

    def layer(self, i: int) -> LayerWeights:
        config, groups, take, fused, matrix = self.config, self.groups, self.take, self.fused, self.matrix
        p = f"model.layers.{i}."
        qk_norm = None
        if config.qk_norm:  # one weight row per head, q's heads first: a single norm call over q and k
            qk_norm = torch.cat(
                [
                    take(p + "self_attn.q_norm.weight")[None].expand(config.num_heads, -1),
                    take(p + "self_attn.k_norm.weight")[None].expand(config.num_kv_heads, -1),
                ]
            )
        return LayerWeights(
            attn_norm=take(p + "input_layernorm.weight"),
            qkv=matrix(p + "attn_qkv", lambda: fused(*groups[p + "attn_qkv"])),
            o=matrix(p + "attn_o", lambda: take(p + "self_attn.o_proj.weight")),
            mlp_norm=take(p + "post_attention_layernorm.weight"),
            gate_up=matrix(p + "mlp_gate_up", lambda: fused(*groups[p + "mlp_gate_up"])),
            down=matrix(p + "mlp_down", lambda: take(p + "mlp.down_proj.weight")),
            qkv_bias=fused(*(p + f"self_attn.{n}_proj.bias" for n in "qkv")) if config.qkv_bias else None,
            o_bias=take(p + "self_attn.o_proj.bias") if config.o_bias else None,
            qk_norm=qk_norm,
        )
