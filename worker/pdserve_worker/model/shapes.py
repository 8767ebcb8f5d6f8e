"""Which tensors a checkpoint of a `ModelConfig` holds, their shapes, and what they weigh.

Pure arithmetic, no torch: the loader checks a checkpoint against it (a wrong shape is an
error naming the tensor, not a reshape failure deep in a matmul), `pdserve info` and the
memory check before loading count bytes with it. Names and shapes are transformers'
(`model.layers.{i}.self_attn.q_proj.weight` is `[heads * head_dim, hidden]`, like `nn.Linear`);
tests/unit/test_model_families.py compares them with transformers' own models.
"""

from __future__ import annotations

from collections.abc import Iterable
from math import prod

from pdserve_common.kv_layout import DTYPE_SIZES
from pdserve_worker.model.config import ModelConfig

Shape = tuple[int, ...]


def global_shapes(config: ModelConfig) -> dict[str, Shape]:
    """The tensors outside the decoder layers: embedding, final norm, and an untied LM head."""
    h, v = config.hidden_size, config.vocab_size
    shapes: dict[str, Shape] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def layer_shapes(config: ModelConfig, layer: int) -> dict[str, Shape]:
    """The tensors of decoder layer `layer`."""
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_heads * d, config.num_kv_heads * d
    p = f"model.layers.{layer}."
    shapes: dict[str, Shape] = {
        p + "input_layernorm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (q, h),
        p + "self_attn.k_proj.weight": (kv, h),
        p + "self_attn.v_proj.weight": (kv, h),
        p + "self_attn.o_proj.weight": (h, q),
        p + "mlp.gate_proj.weight": (i, h),
        p + "mlp.up_proj.weight": (i, h),
        p + "mlp.down_proj.weight": (h, i),
    }
    if config.qkv_bias:
        shapes.update(
            {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,), p + "self_attn.v_proj.bias": (kv,)}
        )
    if config.o_bias:
        shapes[p + "self_attn.o_proj.bias"] = (h,)
    if config.qk_norm:
        shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
    return shapes


def weight_shapes(config: ModelConfig, layers: Iterable[int] | None = None) -> dict[str, Shape]:
    """Every tensor a member holding `layers` (default: all) loads, by HF name."""
    shapes = global_shapes(config)
    for layer in range(config.num_layers) if layers is None else layers:
        shapes.update(layer_shapes(config, layer))
    return shapes


def parameter_count(config: ModelConfig, layers: Iterable[int] | None = None) -> int:
    """Parameters of the model (a tied head counted once), or of a member holding `layers`.

    Arithmetic on one layer (every layer has the same tensors), so a config.json claiming a
    billion layers is counted, and refused by the memory check, without listing them."""
    count = config.num_layers if layers is None else len(layers if isinstance(layers, range) else list(layers))
    per_layer = sum(prod(shape) for shape in layer_shapes(config, 0).values())
    return sum(prod(shape) for shape in global_shapes(config).values()) + count * per_layer


def weight_bytes(config: ModelConfig, dtype: str, layers: Iterable[int] | None = None) -> int:
    """Bytes the weights take in `dtype` once loaded."""
    if dtype not in DTYPE_SIZES:
        raise ValueError(f"weight dtype must be one of {sorted(DTYPE_SIZES)}, got {dtype!r}")
    return parameter_count(config, layers) * DTYPE_SIZES[dtype]
