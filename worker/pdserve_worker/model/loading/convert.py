"""GGUF → HF folder conversion, cached: dequantize once, then start in a fraction of a second.

The converted folder is a plain HF folder (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json, generation_config.json) that transformers loads too; one per dtype: fp32
holds the dequantized values exactly (the source of the others), bf16 loads without a cast. The
safetensors file is memory-mapped, so processes on one host share its pages.

Quantized matrices (Q4_0/Q4_1/Q8_0) have an entry of their own, `{stem}-{key}-quantized`: each
matrix's blocks split exactly (`quant.QuantizedTensor`: `.qweight`, `.scales`, `.mins`), read
from the GGUF's blocks, never requantized; no tokenizer or config (the router derives the
revision from the dtype folder alone). The plain split form, not torch's per-CPU int4 packing.
An entry is keyed by the GGUF's identity (name, size, mtime), the dtype and the converter's
version, and published atomically (a temporary folder renamed into place): a race has one
winner, and a reader never sees a half-written folder.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from safetensors.torch import load_file, save_file

from pdserve_common.logs import kv
from pdserve_worker.kv.cache import torch_dtype
from pdserve_worker.model.loading.weights import read_gguf, read_gguf_quantized
from pdserve_worker.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Bump when the converted folder's content changes, so old entries are not reused.
# 2: generation_config.json carries llama.cpp's end-of-generation ids; qwen2/qwen3 config.json.
CONVERTER_VERSION = 2
MARKER = "pdserve_source.json"
QUANTIZED = "quantized"  # the cache entry of a GGUF's quantized matrices


def cache_root() -> Path:
    """`$PDSERVE_CACHE_DIR`, else `~/.cache/pdserve`."""
    env = os.environ.get("PDSERVE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pdserve"


def gguf_identity(path: Path) -> str:
    """A short key that changes when the file is replaced or modified."""
    st = path.stat()
    raw = f"{path.name}|{st.st_size}|{st.st_mtime_ns}|v{CONVERTER_VERSION}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write the fp32 HF folder of a GGUF file into the existing, empty folder `out_dir`."""
    gguf_path, out = Path(gguf_path), Path(out_dir)
    checkpoint = read_gguf(gguf_path)
    tokenizer = Tokenizer.from_gguf_metadata(checkpoint.metadata)
    tensors = dict(checkpoint.tensors)
    if checkpoint.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # safetensors refuses shared storage; the model ties it again
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(checkpoint.config.to_hf("float32"), indent=2))
    tokenizer.save(out)
    # Every id llama.cpp ends generation on, where an HF folder lists them.
    (out / "generation_config.json").write_text(
        json.dumps(
            {"bos_token_id": checkpoint.config.bos_token_id, "eos_token_id": list(tokenizer.eos_token_ids)}, indent=2
        )
    )
    _mark(out, gguf_path, "float32")
    return out


def recast_folder(fp32_dir: Path, out_dir: Path, dtype: str) -> Path:
    """Copy a converted fp32 folder into `out_dir` with its weights cast to `dtype`."""
    source = json.loads((fp32_dir / MARKER).read_text())
    target = torch_dtype(dtype)
    tensors = {name: t.to(target) for name, t in load_file(str(fp32_dir / "model.safetensors")).items()}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((fp32_dir / "config.json").read_text())
    (out_dir / "config.json").write_text(json.dumps({**config, "torch_dtype": dtype}, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(fp32_dir / name, out_dir / name)
    _mark(out_dir, Path(source["gguf"]), dtype)
    return out_dir


def convert_gguf_quantized(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write the quantized matrices of a GGUF file (possibly none) into the existing, empty folder `out_dir`."""
    gguf_path, out = Path(gguf_path), Path(out_dir)
    _, matrices = read_gguf_quantized(gguf_path)
    tensors: dict = {}
    for name, matrix in matrices.items():
        tensors.update(matrix.tensors(name))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", "content": "pdserve-quantized"})
    _mark(out, gguf_path, QUANTIZED)
    return out


def quantized_gguf(gguf_path: str | Path, root: str | Path | None = None) -> Path:
    """The cached folder of `gguf_path`'s quantized matrices, converting it first if needed (atomic, race-safe)."""
    gguf_path = Path(gguf_path).resolve()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_path} does not exist")
    root = Path(root) if root is not None else cache_root()
    base = f"{gguf_path.stem}-{gguf_identity(gguf_path)}"
    return _publish(root / f"{base}-{QUANTIZED}", lambda tmp: convert_gguf_quantized(gguf_path, tmp))


def _mark(folder: Path, gguf_path: Path, dtype: str) -> None:
    """Written last: its presence says the folder is complete."""
    (folder / MARKER).write_text(
        json.dumps({"gguf": str(gguf_path), "name": gguf_path.stem, "dtype": dtype, "converter": CONVERTER_VERSION})
    )


def converted_gguf(gguf_path: str | Path, dtype: str = "float32", root: str | Path | None = None) -> Path:
    """The cached HF folder of `gguf_path` in `dtype`, converting it first if needed (atomic, race-safe).

    Other dtypes are derived from the fp32 folder (which is made first): the slow part, reading
    and dequantizing the GGUF, then happens once per file whatever dtypes are asked for.
    """
    gguf_path = Path(gguf_path).resolve()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_path} does not exist")
    torch_dtype(dtype)  # reject an unknown dtype before any work
    root = Path(root) if root is not None else cache_root()
    base = f"{gguf_path.stem}-{gguf_identity(gguf_path)}"
    fp32 = _publish(root / f"{base}-float32", lambda tmp: convert_gguf(gguf_path, tmp))
    if dtype == "float32":
        return fp32
    return _publish(root / f"{base}-{dtype}", lambda tmp: recast_folder(fp32, tmp, dtype))


def _publish(final: Path, build: Callable[[Path], object]) -> Path:
    """`final`, built by `build(tmp)` in a private folder and renamed into place unless present."""
    if (final / MARKER).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        log.info(kv(event="model_cache_build", target=final))
        build(tmp)
        # mkdtemp makes the folder private; a shared cache must be readable by other users.
        for path in tmp.iterdir():
            path.chmod(0o644)
        tmp.chmod(0o755)
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process published the same entry first: theirs is as good as ours.
            if not (final / MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
