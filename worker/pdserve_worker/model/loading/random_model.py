"""A small LLaMA of random weights: what `pdserve plan`'s hardware profile times the engine on
(`cli/hw_profile.engine_overheads`), and what the tests' tiny model (tests/support/tiny_model.py)
is built from. The shapes are real, the weights' values are not.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from pdserve_worker.model.config import ModelConfig

TINY_DEFAULTS: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=160,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rope_theta=10000.0,
    rope_scaling=None,
    rms_norm_eps=1e-5,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


def tiny_config(vocab_size: int, **overrides: Any) -> ModelConfig:
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = set(overrides) - fields
    if unknown:
        raise TypeError(f"unknown tiny model overrides {sorted(unknown)}; ModelConfig fields are {sorted(fields)}")
    values = {**TINY_DEFAULTS, "vocab_size": vocab_size, "bos_token_id": 0, "eos_token_ids": (2,), **overrides}
    return ModelConfig(**values)


def tiny_weights(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights scaled so activations and logits stay O(1) through every layer."""
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, scale: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    h, i = config.hidden_size, config.intermediate_size
    q_out, kv_out = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    weights = {
        "model.embed_tokens.weight": normal(config.vocab_size, h, scale=1.0),
        "model.norm.weight": 1.0 + normal(h, scale=0.1),
    }
    if not config.tie_word_embeddings:
        weights["lm_head.weight"] = normal(config.vocab_size, h, scale=h**-0.5)
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}."
        weights.update(
            {
                p + "input_layernorm.weight": 1.0 + normal(h, scale=0.1),
                p + "post_attention_layernorm.weight": 1.0 + normal(h, scale=0.1),
                p + "self_attn.q_proj.weight": normal(q_out, h, scale=h**-0.5),
                p + "self_attn.k_proj.weight": normal(kv_out, h, scale=h**-0.5),
                p + "self_attn.v_proj.weight": normal(kv_out, h, scale=h**-0.5),
                p + "self_attn.o_proj.weight": normal(h, q_out, scale=q_out**-0.5),
                p + "mlp.gate_proj.weight": normal(i, h, scale=h**-0.5),
                p + "mlp.up_proj.weight": normal(i, h, scale=h**-0.5),
                p + "mlp.down_proj.weight": normal(h, i, scale=i**-0.5),
            }
        )
    return weights
