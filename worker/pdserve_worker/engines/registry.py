"""The model engines by name: a new engine is one package with an `EngineType` and one line here.

Each entry names the module and class of the engine (its `capabilities` and its `load`); the module is imported only when that
engine is asked for, so a worker that runs the native engine never imports another engine's
library. An engine outside this package is named as `module:Class` (vLLM's
`kv_connector_module_path` is the model): it loads the same way, with no file here changed.
"""

from __future__ import annotations

import importlib
from typing import cast

from pdserve_worker.engines.base import LAYER_SHARDS, TENSOR_PARALLEL, Engine, EngineError, EngineLoad, EngineType

ENGINES: dict[str, str] = {
    "native": "pdserve_worker.engines.native:NativeEngine",  # pdserve's torch engine (model/)
}
DEFAULT = "native"


def engine_type(name: str) -> EngineType:
    """The class of engine `name` (a registered name or `module:Class`)."""
    target = ENGINES.get(name) or (name if ":" in name else None)
    if target is None:
        raise EngineError(f"engine {name!r} is not registered; expected one of {sorted(ENGINES)} or module:Class")
    module, _, attribute = target.partition(":")
    try:
        found = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as exc:
        raise EngineError(f"engine {name!r}: cannot import {target}: {exc}") from exc
    return cast(EngineType, found)


def load_engine(name: str, request: EngineLoad) -> Engine:
    """Engine `name`, loaded; refused by name, before loading, when the request needs what it
    does not run (a tensor-parallel rank, a layer-sharded member)."""
    kind = engine_type(name)
    needs = {TENSOR_PARALLEL} if request.tp is not None else set()
    if request.layers is not None:
        needs.add(LAYER_SHARDS)
    missing = needs - kind.capabilities
    if missing:
        raise EngineError(f"engine {name!r} does not run {', '.join(sorted(missing))}")
    return kind.load(request)
