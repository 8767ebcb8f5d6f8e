"""llama.cpp's GGUF conventions for the architectures of `model/families` (llama, qwen2, qwen3), as HF terms.

Tensor names: llama.cpp's converter renames HF tensors with the `gguf` package's
`TensorNameMap` (`blk.{i}.attn_q.weight` for `model.layers.{i}.self_attn.q_proj.weight`;
qwen3's `attn_q_norm`/`attn_k_norm`). Only LLaMA's Q and K rows are permuted
(`Family.gguf_permutes_qk`: GGML's "normal" rope rotates adjacent pairs); qwen2 and qwen3 use
the NEOX rope, which rotates halves like HF. tests/unit/test_gguf_families.py checks the table
against `gguf.get_tensor_name_map` and `gguf.MODEL_TENSORS`.

Metadata: `{arch}.block_count`, `.context_length`, `.embedding_length`, `.feed_forward_length`,
`.attention.head_count[_kv]`, `.attention.key_length` (head_dim), `.rope.freq_base`,
`.attention.layer_norm_rms_epsilon`, and `.rope.scaling.{type,factor,original_context_length,
yarn_beta_fast,yarn_beta_slow}` as `TextModel.set_gguf_parameters` writes them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pdserve_worker.model.config import ModelConfig
from pdserve_worker.model.families import GGUF_FAMILIES

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs.weight",
}
_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_HF_BLOCK_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
_HF_TO_BLOCK = {hf: g for g, hf in _BLOCK.items()}
_HF_TO_GLOBAL = {hf: g for g, hf in _GLOBAL.items()}

# llama.cpp's rope scaling keys this engine reads; the YaRN keys it does not are refused by name.
_YARN_UNSUPPORTED = ("yarn_ext_factor", "yarn_attn_factor", "yarn_log_multiplier", "attn_factor")


def gguf_to_hf_name(name: str) -> str:
    """HF parameter name of a llama.cpp tensor name (`blk.3.attn_q.bias` → `model.layers.3.self_attn.q_proj.bias`)."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    match = _BLOCK_RE.match(name)
    if match and match.group(2) in _BLOCK:
        return f"model.layers.{match.group(1)}.{_BLOCK[match.group(2)]}.{match.group(3)}"
    raise ValueError(f"GGUF tensor {name!r} has no counterpart in this engine")


def hf_to_gguf_name(name: str) -> str:
    """Inverse of `gguf_to_hf_name`."""
    if name in _HF_TO_GLOBAL:
        return _HF_TO_GLOBAL[name]
    match = _HF_BLOCK_RE.match(name)
    if match and match.group(2) in _HF_TO_BLOCK:
        return f"blk.{match.group(1)}.{_HF_TO_BLOCK[match.group(2)]}.{match.group(3)}"
    raise ValueError(f"HF tensor {name!r} has no GGUF counterpart in this engine")


def read_gguf_metadata(path: str | Path) -> tuple[dict[str, Any], Any]:
    """(key → value, reader) of a GGUF file; arrays become lists, strings str (no torch needed)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        meta[key] = field.contents()
    return meta, reader


def permutes_qk(arch: str) -> bool:
    """Whether llama.cpp stored this architecture's Q/K rows permuted (GGML normal rope)."""
    return GGUF_FAMILIES[arch].gguf_permutes_qk


def config_from_gguf(meta: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    """The model a GGUF file describes, from its key/values (decoded to Python values) and tensor names."""
    arch = meta.get("general.architecture")
    if arch not in GGUF_FAMILIES:
        raise ValueError(f"GGUF general.architecture {arch!r} is not supported; expected one of {tuple(GGUF_FAMILIES)}")
    fam = GGUF_FAMILIES[arch]

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}")
        return value

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    context = int(get("context_length"))
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or [])
    rope_scaling = _rope_scaling(meta, arch, context)
    max_positions = context
    if rope_scaling and rope_scaling["rope_type"] == "yarn":
        max_positions = max(context, int(rope_scaling["original_max_position_embeddings"] * rope_scaling["factor"]))
    qkv_bias = "blk.0.attn_q.bias" in tensor_names
    qk_norm = "blk.0.attn_q_norm.weight" in tensor_names
    fam.check_gguf_tensors(qkv_bias, qk_norm)
    eos = meta.get("tokenizer.ggml.eos_token_id")
    window = meta.get(f"{arch}.attention.sliding_window")
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv") or heads),
        head_dim=int(
            meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count") or hidden // heads
        ),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=max_positions,
        # llama.cpp writes no output.weight when the LM head is the embedding matrix.
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        architecture=fam.model_type,
        qkv_bias=qkv_bias,
        o_bias="blk.0.attn_output.bias" in tensor_names,
        qk_norm=qk_norm,
        sliding_window=None if window is None else int(window),
    )


def _rope_scaling(meta: dict[str, Any], arch: str, context: int) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if factor is None:
        raise ValueError(f"GGUF {arch}.rope.scaling.type {kind!r} without {arch}.rope.scaling.factor")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        for key in _YARN_UNSUPPORTED:
            if f"{arch}.rope.scaling.{key}" in meta:
                raise ValueError(f"GGUF {arch}.rope.scaling.{key} is not supported")
        scaling: dict[str, Any] = {
            "rope_type": "yarn",
            "factor": float(factor),
            "original_max_position_embeddings": int(
                meta.get(f"{arch}.rope.scaling.original_context_length") or context
            ),
        }
        for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if (value := meta.get(f"{arch}.rope.scaling.{gguf_key}")) is not None:
                scaling[hf_key] = float(value)
        return scaling
    raise ValueError(f"GGUF {arch}.rope.scaling.type {kind!r} is not supported (none, linear, yarn)")
