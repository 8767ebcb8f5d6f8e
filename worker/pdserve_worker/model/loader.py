"""One call from a path (or nothing: the bundled default) to a ready model and its tokenizer."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pdserve_worker.kv.cache import torch_dtype
from pdserve_worker.logs import kv
from pdserve_worker.model.config import ModelConfig
from pdserve_worker.model.convert import MARKER, converted_gguf
from pdserve_worker.model.default_model import DEFAULT_MODEL_NAME, default_model_path
from pdserve_worker.model.generation_config import GenerationDefaults
from pdserve_worker.model.llama import LlamaModel
from pdserve_worker.model.memory import check_fits, device_available
from pdserve_worker.model.shapes import weight_bytes, weight_shapes
from pdserve_worker.model.tokenizer import Tokenizer
from pdserve_worker.model.weights import read_safetensors_dir

log = logging.getLogger("pdserve.model.loader")

DEVICES = ("cpu", "cuda", "npu")


@dataclass
class LoadedModel:
    model: LlamaModel
    tokenizer: Tokenizer
    config: ModelConfig
    name: str
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)


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


def loaded_bytes(config: ModelConfig, dtype: str, layers: range, device: torch.device) -> int:
    """Memory the weights of `layers` take once loaded on `device`: their bytes in `dtype`, plus on
    the CPU a second copy of a tied embedding (the LM head is packed for the matmul separately)."""
    needed = weight_bytes(config, dtype, layers)
    if device.type == "cpu" and config.tie_word_embeddings:
        needed += config.vocab_size * config.hidden_size * torch_dtype(dtype).itemsize
    return needed


def load_model(
    path: str | Path | None = None,
    dtype: str = "bfloat16",
    device: str = "cpu",
    layers: range | None = None,
) -> LoadedModel:
    """Load weights (GGUF via the conversion cache, or an HF folder) and the tokenizer.

    `layers` keeps only that range of decoder layers (a layer-sharded worker), and only those
    are read. Before any weight is read, the memory they need is checked against what the
    device has (`ModelDoesNotFit`, a RuntimeError, names both).
    """
    started = time.perf_counter()
    torch_device = resolve_device(device)
    folder, name = model_folder(path, dtype)
    hf_config = json.loads((folder / "config.json").read_text())
    config = ModelConfig.from_hf(hf_config)
    held = range(config.num_layers) if layers is None else layers
    available, source = device_available(torch_device)
    check_fits(loaded_bytes(config, dtype, held, torch_device), available, source,
               what=f"the weights of {name} (layers {held.start}..{held.stop - 1}, {dtype})", device=str(torch_device))
    generation = GenerationDefaults.from_folder(folder)
    eos = list(dict.fromkeys([*config.eos_token_ids, *generation.eos_token_ids]))
    tokenizer = Tokenizer.from_dir(folder, extra_eos_token_ids=eos)
    names = [*weight_shapes(config, held), "rope_freqs.weight"]
    model = LlamaModel(config, read_safetensors_dir(folder, names), dtype=torch_dtype(dtype), device=torch_device,
                       layers=layers)
    log.info(kv(event="model_loaded", name=name, architecture=config.architecture, folder=folder, dtype=dtype,
                device=torch_device, seconds=round(time.perf_counter() - started, 3)))
    return LoadedModel(model=model, tokenizer=tokenizer, config=config, name=name, generation=generation)
