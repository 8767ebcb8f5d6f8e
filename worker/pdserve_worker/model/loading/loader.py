"""One call from a path (or nothing: the bundled default) to a ready model and its tokenizer."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pdserve_common.logs import kv
from pdserve_worker.kv.cache import torch_dtype
from pdserve_worker.model.config import ModelConfig
from pdserve_worker.model.layers.llama import LlamaModel, ModelPart
from pdserve_worker.model.layers.quant import Kind, QuantizedTensor
from pdserve_worker.model.layers.tensor_parallel import TPShard, shard_weights
from pdserve_worker.model.layers.weight_routes import check_weights_choice, groups, loaded_weight_bytes, plan, summary
from pdserve_worker.model.loading.convert import MARKER, converted_gguf, quantized_gguf
from pdserve_worker.model.loading.default_model import DEFAULT_MODEL_NAME, default_model_path, model_argument
from pdserve_worker.model.loading.generation_config import GenerationDefaults
from pdserve_worker.model.loading.memory import check_fits, device_available
from pdserve_worker.model.loading.weights import read_quantized_dir, read_safetensors_dir
from pdserve_worker.model.shapes import weight_shapes
from pdserve_worker.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)

DEVICES = ("cpu", "cuda", "npu")


@dataclass
class LoadedModel:
    model: LlamaModel
    tokenizer: Tokenizer
    config: ModelConfig
    name: str
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)
    # A tensor-parallel rank's place (model/layers/tensor_parallel.py): `config` is then its
    # share of the model (its heads, its KV heads), `tp.config` the whole model's.
    tp: TPShard | None = None

    @property
    def routes(self) -> dict[str, str]:
        """Route per layer type (`attn_qkv`, ..., `lm_head`): how its matrices are multiplied."""
        return summary(self.model.routes)


def resolve_device(device: str) -> torch.device:
    """A torch device for "cpu", "cuda[:n]" or "npu[:n]"; torch_npu is imported only for npu."""
    kind = device.split(":", 1)[0]
    if kind not in DEVICES:
        raise ValueError(f"device {device!r} is not supported; expected one of {DEVICES}")
    if kind == "npu":
        try:
            import torch_npu  # noqa: F401  (registers the "npu" device with torch)
        except ImportError as exc:
            raise RuntimeError(f"device {device!r} needs torch_npu (pip install 'pdserve[npu]'): {exc}") from exc
    if kind == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {device!r} requested but torch.cuda.is_available() is False")
    return torch.device(device)


def model_folder(path: str | Path | None, dtype: str = "float32") -> tuple[Path, str]:
    """(HF folder to load, model name) for a GGUF file, an HF folder, or None (the default model).

    A GGUF is converted (once, cached) to an HF folder in `dtype`.
    """
    path = model_argument(path)
    if path is None:
        return converted_gguf(default_model_path(), dtype), DEFAULT_MODEL_NAME
    p = Path(path).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return converted_gguf(p, dtype), p.stem
    if p.is_dir() and (p / "config.json").is_file():
        name = p.name
        if (p / MARKER).is_file():
            name = json.loads((p / MARKER).read_text()).get("name", name)
        return p, name
    raise FileNotFoundError(f"model path {str(p)!r} is neither a .gguf file nor a folder with config.json")


def gguf_source(path: str | Path | None) -> Path | None:
    """The GGUF file behind `path` (None or builtin:smollm2: the bundled default), or None for an HF folder."""
    path = model_argument(path)
    if path is None:
        return default_model_path()
    p = Path(path).expanduser()
    return p if p.is_file() and p.suffix == ".gguf" else None


def stored_kinds(folder: Path) -> dict[str, Kind]:
    """The quantized form of each matrix a quantized cache folder holds (from dtypes; no data read)."""
    from safetensors import safe_open

    kinds: dict[str, Kind] = {}
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            if key.endswith(".qweight"):
                kinds[key.removesuffix(".qweight")] = "q4" if f.get_slice(key).get_dtype() == "U8" else "q8"
    return kinds


def loaded_bytes(
    config: ModelConfig, dtype: str, layers: range, device: torch.device, routes: dict[str, str] | None = None
) -> int:
    """Memory the weights of `layers` take once loaded on `device` on the planned `routes`
    (default: all dequantized): dequantized ones in `dtype`, quantized ones in their packed size,
    plus a second copy of a tied embedding where the LM head is held apart from it (packed for
    the CPU's matmul, or quantized)."""
    return loaded_weight_bytes(config, dtype, routes or {}, layers, tied_copy=device.type == "cpu")


def _read_quantized(
    config: ModelConfig, held: range, routes: dict[str, str], folder: Path | None, stored: dict[str, Kind]
) -> dict[str, QuantizedTensor]:
    """The quantized parts the routes hold quantized, from the quantized cache entry: their float
    copies are then not even read (but the embedding rows always are: the lookup needs them)."""
    if folder is None:
        return {}
    wanted = {n for group, parts in groups(config, held).items() if routes[group] != "dequantized" for n in parts}
    return read_quantized_dir(folder, [n for n in wanted if n in stored])


def _since(started: float) -> float:
    return round(time.perf_counter() - started, 3)


def _read_floats(
    config: ModelConfig, folder: Path, held: range, quantized: dict[str, QuantizedTensor], shard: TPShard | None
) -> dict[str, torch.Tensor]:
    """The float tensors a model holding `held` needs (not the matrices it holds quantized, but
    always the embedding rows: the lookup needs them); a tensor-parallel rank's slices of them."""
    names = [
        n
        for n in [*weight_shapes(config, held), "rope_freqs.weight"]
        if n not in quantized or n == "model.embed_tokens.weight"
    ]
    tensors = read_safetensors_dir(folder, names)
    return tensors if shard is None else shard_weights(shard, tensors)


def load_model(
    path: str | Path | None = None,
    dtype: str = "bfloat16",
    device: str = "cpu",
    layers: range | None = None,
    weights: str = "dequantized",
    tp: tuple[int, int] = (1, 0),
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> LoadedModel:
    """Load weights (GGUF via the conversion cache, or an HF folder) and the tokenizer.

    `layers` keeps only that range of decoder layers (a layer-sharded worker), and only those
    are read. `weights` (`weight_routes`) says how the matrices are held: "auto" keeps a GGUF's
    Q4_0/Q4_1/Q8_0 matrices quantized (read from the quantized cache entry, never
    dequantized), "int4"/"int8" quantize every matrix, "dequantized" (the default here; the
    CLIs default to auto) holds them in `dtype`. Before any weight is read, the memory they
    need is checked against what the device has (`ModelDoesNotFit`, a RuntimeError, names both).

    `tp` = (size, rank): load rank `rank`'s share of a tensor-parallel group (size > 1), whose
    o_proj and down_proj partial products `reduce` sums over the group. Quantized routes then
    quantize the rank's float slices (a checkpoint's quantized blocks are not sliced).
    """
    started = time.perf_counter()
    torch_device = resolve_device(device)
    check_weights_choice(weights, torch_device.type)
    folder, name = model_folder(path, dtype)
    hf_config = json.loads((folder / "config.json").read_text())
    full = ModelConfig.from_hf(hf_config)
    shard = TPShard(full, *tp) if tp[0] > 1 else None
    config = shard.local_config if shard is not None else full
    held = range(config.num_layers) if layers is None else layers
    gguf_path = gguf_source(path) if weights != "dequantized" and torch_device.type == "cpu" else None
    quantized_folder = quantized_gguf(gguf_path) if gguf_path is not None else None
    stored = stored_kinds(quantized_folder) if quantized_folder is not None else {}
    routes = plan(config, weights, stored, held, torch_device.type)
    available, source = device_available(torch_device)
    check_fits(
        loaded_bytes(config, dtype, held, torch_device, routes),
        available,
        source,
        what=f"the weights of {name} (layers {held.start}..{held.stop - 1}, {dtype}, weights {weights})",
        device=str(torch_device),
    )
    generation = GenerationDefaults.from_folder(folder)
    eos = list(dict.fromkeys([*config.eos_token_ids, *generation.eos_token_ids]))
    tokenizer = Tokenizer.from_dir(folder, extra_eos_token_ids=eos)
    # (a tensor-parallel rank reads float weights and quantizes its slices: blocks are not sliced)
    quantized = _read_quantized(config, held, routes, quantized_folder if shard is None else None, stored)
    tensors = _read_floats(config, folder, held, quantized, shard)
    part = ModelPart(layers=layers, quantized=quantized, routes=routes, reduce=reduce)
    model = LlamaModel(config, tensors, torch_dtype(dtype), torch_device, part)
    routes_text = ",".join(f"{k}:{v}" for k, v in summary(model.routes).items())
    loaded = {"folder": folder, "dtype": dtype, "device": torch_device, "weights": weights, "routes": routes_text}
    if shard is not None:
        loaded["tp"] = f"{shard.rank}/{shard.size}"
    log.info(kv(event="model_loaded", name=name, architecture=config.architecture, **loaded, seconds=_since(started)))
    return LoadedModel(model=model, tokenizer=tokenizer, config=config, name=name, generation=generation, tp=shard)
