"""What a model costs in memory and how many KV slots fit next to it: `pdserve info --model`.

A decode worker holds the weights of its layers (plus the embedding and the LM head, which
every member of a layer-sharded group loads) and a KV pool of `slots` slots of `max_len`
tokens each (DESIGN.md's layout: layers x (K, V) x max_len x kv_heads x head_dim x dtype).
So for a memory budget M per device, the slots that fit are
`floor((M - member weights) / member slot bytes)`, the smallest over the group's members.
Activations and the runtime's own memory come on top: leave headroom in M.

Torch-free: reads config.json (or a GGUF file's metadata, without converting it).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve_common.kv_layout import DTYPE_SIZES, shard_layers
from pdserve_worker.model.config import ModelConfig
from pdserve_worker.model.families import FAMILIES
from pdserve_worker.model.loading.generation_config import GenerationDefaults
from pdserve_worker.model.shapes import parameter_count

GIB = 1024**3
_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "ki": 2**10,
    "kib": 2**10,
    "mi": 2**20,
    "mib": 2**20,
    "gi": 2**30,
    "gib": 2**30,
    "ti": 2**40,
    "tib": 2**40,
}


def parse_bytes(text: str) -> int:
    """Bytes of "64GiB", "64Gi" (Kubernetes), "64G"/"64GB" (decimal), "1.5TiB" or a plain number."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"memory {text!r} is not a size like 64GiB, 64Gi, 64GB or 68719476736")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


@dataclass(frozen=True)
class Sizing:
    """Weights and KV of each member of a decode group of `layer_shards` (1: one worker)."""

    config: ModelConfig
    dtype: str
    max_len: int
    layer_shards: int = 1

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_SIZES)}, got {self.dtype!r}")
        self.config.check_max_len(self.max_len)

    @property
    def members(self) -> list[range]:
        return shard_layers(self.config.num_layers, self.layer_shards)

    def weight_bytes(self, member: range) -> int:
        return parameter_count(self.config, member) * DTYPE_SIZES[self.dtype]

    def slot_bytes(self, member: range) -> int:
        """One slot of `max_len` tokens of the member's layers (KVLayout.bytes_per_slot)."""
        per_layer_token = 2 * self.config.num_kv_heads * self.config.head_dim * DTYPE_SIZES[self.dtype]
        return len(member) * self.max_len * per_layer_token

    def slots_fitting(self, memory: int) -> int:
        """Slots of max_len every member can hold within `memory` bytes next to its weights (0: none)."""
        return min(max(0, (memory - self.weight_bytes(m)) // self.slot_bytes(m)) for m in self.members)


def read_config(path: str | Path) -> tuple[ModelConfig, dict[str, Any]]:
    """(config, facts about the checkpoint) of an HF folder or a GGUF file."""
    p = Path(path).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        from pdserve_worker.model.loading.gguf_format import config_from_gguf, read_gguf_metadata

        meta, reader = read_gguf_metadata(p)
        config = config_from_gguf(meta, {t.name for t in reader.tensors})
        file_type = meta.get("general.file_type")
        try:
            import gguf

            file_type = gguf.LlamaFileType(file_type).name if file_type is not None else None
        except (ImportError, ValueError):
            pass
        from pdserve_worker.model.layers.quant_blocks import QUANTIZED_TYPES
        from pdserve_worker.model.loading.gguf_format import gguf_to_hf_name

        stored = {
            gguf_to_hf_name(t.name): QUANTIZED_TYPES[t.tensor_type.name]
            for t in reader.tensors
            if t.tensor_type.name in QUANTIZED_TYPES and len(t.shape) == 2
        }
        return config, {
            "format": "gguf",
            "name": p.stem,
            "checkpoint_dtype": file_type,
            "quantized": stored,
            "generation": GenerationDefaults(eos_token_ids=config.eos_token_ids),
        }
    if p.is_dir() and (p / "config.json").is_file():
        data = json.loads((p / "config.json").read_text())
        return ModelConfig.from_hf(data), {
            "format": "hf",
            "name": p.name,
            "checkpoint_dtype": data.get("torch_dtype") or data.get("dtype"),
            "quantized": {},
            "generation": GenerationDefaults.from_folder(p),
        }
    raise FileNotFoundError(f"model path {str(p)!r} is neither a .gguf file nor a folder with config.json")


def human_count(n: int) -> str:
    for unit, size in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def report(
    path: str | Path,
    dtype: str = "bfloat16",
    max_len: int | None = None,
    memory: int | None = None,
    layer_shards: int = 1,
    weights: str = "auto",
    tp: int = 1,
) -> dict[str, Any]:
    """Everything `pdserve info --model` prints, as one JSON-able dict (max_len None: the default
    a worker would serve, `ModelConfig.serving_max_len`; `tp` > 1: each tensor-parallel rank's
    share, or ValueError naming the sizes the heads allow).

    `weights_bytes` is the model in `dtype` (what an accelerator holds); `cpu_routes` and
    `cpu_weights_bytes` what a CPU worker with `--weights` holds (`weight_routes`)."""
    from pdserve_worker.model.layers.weight_routes import check_weights_choice, loaded_weight_bytes, plan, summary

    check_weights_choice(weights, "cpu")
    config, facts = read_config(path)
    max_len = config.serving_max_len(max_len)
    routes = plan(config, weights, facts["quantized"], range(config.num_layers))
    sizing = Sizing(config, dtype, max_len, layer_shards)
    params = parameter_count(config)
    out: dict[str, Any] = {
        "path": str(path),
        "name": facts["name"],
        "format": facts["format"],
        "architecture": config.architecture,
        "hf_class": FAMILIES[config.architecture].hf_class,
        "parameters": params,
        "parameters_human": human_count(params),
        "checkpoint_dtype": facts["checkpoint_dtype"],
        "dtype": dtype,
        "weights_bytes": params * DTYPE_SIZES[dtype],
        "weights_gib": round(params * DTYPE_SIZES[dtype] / GIB, 2),
        "weights": weights,
        "cpu_routes": summary(routes),
        "cpu_weights_bytes": loaded_weight_bytes(config, dtype, routes, range(config.num_layers), tied_copy=True),
        **_shape(config),
        "kv_bytes_per_token": config.kv_bytes_per_token(dtype),
        "max_len": max_len,
        "slot_bytes": sum(sizing.slot_bytes(m) for m in sizing.members),
        "generation": facts["generation"].to_dict(),
    }
    if layer_shards > 1:
        out["members"] = [
            {
                "layers": [m.start, m.stop - 1],
                "weights_bytes": sizing.weight_bytes(m),
                "slot_bytes": sizing.slot_bytes(m),
            }
            for m in sizing.members
        ]
    if memory is not None:
        out["memory"] = _fit(sizing, memory, layer_shards)
    if tp > 1:
        out["tensor_parallel"] = tp_ranks(config, dtype, routes, tp)
    return out


def tp_ranks(config: ModelConfig, dtype: str, routes: dict[str, str], tp: int) -> list[dict[str, Any]]:
    """What each rank of a tensor-parallel instance holds (model/layers/tensor_parallel.py): its
    heads, its weights (in `dtype`, and on a CPU worker's `routes`) and KV bytes per token."""
    from pdserve_worker.model.layers.tensor_parallel import TPShard
    from pdserve_worker.model.layers.weight_routes import loaded_weight_bytes

    out = []
    for rank in range(tp):
        shard = TPShard(config, tp, rank)
        local = shard.local_config
        out.append(
            {
                "rank": rank,
                "heads": [shard.heads.start, shard.heads.stop - 1],
                "kv_heads": [shard.kv_heads.start, shard.kv_heads.stop - 1],
                "pushes_kv": bool(shard.pushed_kv_heads),  # (a replica's rank leaves it to another)
                "weights_bytes": parameter_count(local) * DTYPE_SIZES[dtype],
                "cpu_weights_bytes": loaded_weight_bytes(local, dtype, routes, range(local.num_layers), tied_copy=True),
                "kv_bytes_per_token": local.kv_bytes_per_token(dtype),
            }
        )
    return out


def _shape(config: ModelConfig) -> dict[str, Any]:
    """The architecture's numbers, as config.json states them."""
    return {
        "layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "heads": config.num_heads,
        "kv_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "qkv_bias": config.qkv_bias,
        "qk_norm": config.qk_norm,
        "tie_word_embeddings": config.tie_word_embeddings,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "sliding_window": config.sliding_window,
        "max_position_embeddings": config.max_position_embeddings,
    }


def _fit(sizing: Sizing, memory: int, layer_shards: int) -> dict[str, Any]:
    """How the model fits a per-process memory budget: slots, and what the weights leave."""
    worst = max(sizing.members, key=sizing.weight_bytes)
    return {
        "budget_bytes": memory,
        "budget_gib": round(memory / GIB, 2),
        "layer_shards": layer_shards,
        "slots": sizing.slots_fitting(memory),
        "weights_fit": all(sizing.weight_bytes(m) <= memory for m in sizing.members),
        "free_after_weights_gib": round((memory - sizing.weight_bytes(worst)) / GIB, 2),
    }
