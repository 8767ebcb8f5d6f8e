"""Checkpoint readers: a GGUF file (dequantized, or its Q4_0/Q4_1/Q8_0 matrices kept as they
are) or an HF safetensors folder, all under HF names.

GGUF tensors are dequantized to fp32 by the `gguf` package and renamed by llama.cpp's
conventions (`gguf_format`). llama.cpp's converter permutes the rows of LLaMA's Q and K
projections so that RoPE rotates adjacent pairs (GGML's "normal" RoPE); this engine, like HF
checkpoints, rotates the two halves of each head, so for llama files the permutation is undone
here (`unpermute_qk`). qwen2/qwen3 files are stored unpermuted (NEOX rope).

An HF folder is read through its `model.safetensors.index.json` when it is sharded, and only
the tensors asked for are read (a layer-sharded member reads its layers, not the whole model);
safetensors maps the files, so processes on one host share their pages.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pdserve_worker.model.config import ModelConfig
from pdserve_worker.model.layers.quant import QuantizedTensor, from_gguf_blocks
from pdserve_worker.model.layers.quant_blocks import QUANTIZED_TYPES as GGUF_KINDS
from pdserve_worker.model.loading.gguf_format import config_from_gguf, gguf_to_hf_name, permutes_qk, read_gguf_metadata

__all__ = [
    "GGUFCheckpoint",
    "gguf_to_hf_name",
    "permute_qk",
    "unpermute_qk",
    "read_gguf",
    "read_gguf_metadata",
    "read_gguf_quantized",
    "read_quantized_dir",
    "read_safetensors_dir",
    "safetensors_files",
]


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


def _qk_heads(config: ModelConfig, name: str) -> int | None:
    """Heads whose rows llama.cpp permuted in tensor `name` (HF name), or None."""
    if not permutes_qk(config.architecture):
        return None
    if name.endswith("self_attn.q_proj.weight"):
        return config.num_heads
    if name.endswith("self_attn.k_proj.weight"):
        return config.num_kv_heads
    return None


def read_gguf_quantized(path: str | Path) -> tuple[ModelConfig, dict[str, QuantizedTensor]]:
    """The config and every Q4_0/Q4_1/Q8_0 matrix of a GGUF file, blocks kept exactly (`quant`),
    under HF names, LLaMA's Q/K rows unpermuted (a row permutation: no value changes)."""
    meta, reader = read_gguf_metadata(path)
    config = config_from_gguf(meta, {t.name for t in reader.tensors})
    out: dict[str, QuantizedTensor] = {}
    for t in reader.tensors:
        if t.tensor_type.name not in GGUF_KINDS or len(t.shape) != 2:
            continue
        shape = (int(t.shape[1]), int(t.shape[0]))  # GGUF lists dimensions fastest first
        name = gguf_to_hf_name(t.name)
        tensor = from_gguf_blocks(t.data, t.tensor_type.name, shape)
        heads = _qk_heads(config, name)
        if heads is not None:
            tensor = tensor.rows(unpermute_qk(torch.arange(shape[0])[:, None], heads)[:, 0])
        out[name] = tensor
    return config, out


def read_quantized_dir(folder: str | Path, names: Iterable[str] | None = None) -> dict[str, QuantizedTensor]:
    """The quantized matrices a conversion-cache folder holds (`convert.quantized_gguf`): all, or those of `names`."""
    from safetensors import safe_open

    path = Path(folder) / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        held = {k.rsplit(".", 1)[0] for k in f.keys()}
        wanted = held if names is None else [n for n in names if n in held]
        return {name: QuantizedTensor.from_tensors(f.get_tensor, name) for name in wanted}


def read_gguf(path: str | Path) -> GGUFCheckpoint:
    """Dequantize every tensor of a llama/qwen2/qwen3 GGUF file to fp32, under HF names (LLaMA Q/K unpermuted)."""
    from gguf.quants import dequantize

    meta, reader = read_gguf_metadata(path)
    config = config_from_gguf(meta, {t.name for t in reader.tensors})
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        array = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        # F32 tensors come back as read-only views of the memory-mapped file: copy those.
        tensor = torch.from_numpy(array if array.flags.writeable else array.copy())
        name = gguf_to_hf_name(t.name)
        heads = _qk_heads(config, name)
        if heads is not None:
            tensor = unpermute_qk(tensor, heads)
        tensors[name] = tensor.contiguous()
    return GGUFCheckpoint(config=config, tensors=tensors, metadata=meta)


def safetensors_files(folder: str | Path) -> dict[str, str]:
    """{tensor name: file name} of an HF folder: the index's weight_map, or every tensor of model.safetensors.

    Shard names must be plain file names inside the folder: an index pointing elsewhere
    (`../`, absolute paths) is refused rather than followed.
    """
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{index}: not a safetensors index with a weight_map ({exc})") from None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: weight_map must be an object, got {type(weight_map).__name__}")
        for file in set(weight_map.values()):
            if not isinstance(file, str) or Path(file).name != file or file in (".", ".."):
                raise ValueError(f"{index}: shard {file!r} is not a file name inside the folder")
            if not (folder / file).is_file():
                raise FileNotFoundError(f"{index} lists shard {file!r}, which is not in {folder}")
        return dict(weight_map)
    single = folder / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return {name: "model.safetensors" for name in f.keys()}
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {folder}")


def read_safetensors_dir(folder: str | Path, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """Tensors of an HF folder under HF names: all of them, or those of `names` that it holds.

    Checkpoints saved from the bare decoder (`embed_tokens.weight`, no `model.` prefix) are
    renamed to the causal-LM names.
    """
    from safetensors import safe_open

    folder = Path(folder)
    files = safetensors_files(folder)
    bare = "model.embed_tokens.weight" not in files and "embed_tokens.weight" in files
    stored = {(_with_prefix(k) if bare else k): k for k in files}  # HF name -> name in the file
    wanted = list(stored) if names is None else [n for n in names if n in stored]
    by_file: dict[str, list[str]] = {}
    for name in wanted:
        by_file.setdefault(files[stored[name]], []).append(name)
    tensors: dict[str, torch.Tensor] = {}
    for file, group in sorted(by_file.items()):
        with safe_open(str(folder / file), framework="pt") as f:
            held = set(f.keys())
            for name in group:
                if stored[name] not in held:
                    raise ValueError(f"{folder / file} lacks tensor {stored[name]!r}, which the index places there")
                tensors[name] = f.get_tensor(stored[name])
    return tensors


def _with_prefix(name: str) -> str:
    return name if name.startswith("lm_head.") else f"model.{name}"
