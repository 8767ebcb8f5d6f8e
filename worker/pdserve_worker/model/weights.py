"""Checkpoint readers: a GGUF file (dequantized) or an HF safetensors folder, both to HF names.

GGUF tensors are dequantized to fp32 by the `gguf` package. llama.cpp's converter permutes the
rows of LLaMA's Q and K projections so that RoPE rotates adjacent pairs (GGML's "normal"
RoPE); this engine, like HF checkpoints, rotates the two halves of each head, so the
permutation is undone here (`unpermute_qk`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pdserve_worker.model.config import ModelConfig

_GGUF_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs.weight",
}
_GGUF_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def gguf_to_hf_name(name: str) -> str:
    """HF parameter name of a llama.cpp tensor name (`blk.3.attn_q.weight` → `model.layers.3.self_attn.q_proj.weight`)."""
    if name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[name]
    match = _BLOCK_RE.match(name)
    if match and match.group(2) in _GGUF_BLOCK:
        return f"model.layers.{match.group(1)}.{_GGUF_BLOCK[match.group(2)]}.{match.group(3)}"
    raise ValueError(f"GGUF tensor {name!r} has no LLaMA counterpart")


def permute_qk(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's Q/K row permutation (HF rotate-half layout → GGML interleaved pairs)."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def unpermute_qk(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of `permute_qk`: GGML interleaved pairs → HF rotate-half layout."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


@dataclass
class GGUFCheckpoint:
    config: ModelConfig
    tensors: dict[str, torch.Tensor]  # HF names, fp32
    metadata: dict[str, Any]  # every key/value of the file, as Python values


def read_gguf_metadata(path: str | Path) -> tuple[dict[str, Any], Any]:
    """(key → value, reader) of a GGUF file; arrays become lists, strings str."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        meta[key] = field.contents()
    return meta, reader


def read_gguf(path: str | Path) -> GGUFCheckpoint:
    """Dequantize every tensor of a LLaMA GGUF file to fp32, under HF names, Q/K unpermuted."""
    from gguf.quants import dequantize

    meta, reader = read_gguf_metadata(path)
    config = ModelConfig.from_gguf(meta, {t.name for t in reader.tensors})
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        array = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        # F32 tensors come back as read-only views of the memory-mapped file: copy those.
        tensor = torch.from_numpy(array if array.flags.writeable else array.copy())
        name = gguf_to_hf_name(t.name)
        if name.endswith("self_attn.q_proj.weight"):
            tensor = unpermute_qk(tensor, config.num_heads)
        elif name.endswith("self_attn.k_proj.weight"):
            tensor = unpermute_qk(tensor, config.num_kv_heads)
        tensors[name] = tensor.contiguous()
    return GGUFCheckpoint(config=config, tensors=tensors, metadata=meta)


def read_safetensors_dir(folder: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF folder (`model.safetensors` or shards listed in its index), HF names."""
    from safetensors.torch import load_file

    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {folder}")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(str(folder / name)))
    # Checkpoints saved from the bare decoder lack the "model." prefix.
    if "model.embed_tokens.weight" not in tensors and "embed_tokens.weight" in tensors:
        tensors = {(k if k.startswith("lm_head.") else f"model.{k}"): v for k, v in tensors.items()}
    return tensors
