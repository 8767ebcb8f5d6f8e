"""Checkpoint readers: a GGUF file (dequantized) or an HF safetensors folder, both to HF names.

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
from pdserve_worker.model.gguf_format import config_from_gguf, gguf_to_hf_name, permutes_qk, read_gguf_metadata

__all__ = ["GGUFCheckpoint", "gguf_to_hf_name", "permute_qk", "unpermute_qk", "read_gguf", "read_gguf_metadata",
           "read_safetensors_dir", "safetensors_files"]


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


def read_gguf(path: str | Path) -> GGUFCheckpoint:
    """Dequantize every tensor of a llama/qwen2/qwen3 GGUF file to fp32, under HF names (LLaMA Q/K unpermuted)."""
    from gguf.quants import dequantize

    meta, reader = read_gguf_metadata(path)
    config = config_from_gguf(meta, {t.name for t in reader.tensors})
    unpermute = permutes_qk(config.architecture)
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        array = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        # F32 tensors come back as read-only views of the memory-mapped file: copy those.
        tensor = torch.from_numpy(array if array.flags.writeable else array.copy())
        name = gguf_to_hf_name(t.name)
        if unpermute and name.endswith("self_attn.q_proj.weight"):
            tensor = unpermute_qk(tensor, config.num_heads)
        elif unpermute and name.endswith("self_attn.k_proj.weight"):
            tensor = unpermute_qk(tensor, config.num_kv_heads)
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
