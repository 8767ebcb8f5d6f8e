"""The model engines by name: a new engine is one package with an `EngineType` and one line here.

Each entry names the module and class of the engine (its `capabilities` and its `load`); the
module is imported only when that engine is asked for, so a worker that runs the native engine
never imports another engine's library. An engine package outside pdserve registers itself with
one line of its own metadata, an entry point in the `pdserve.engines` group (`name =
module:Class`, as vLLM's plugins use `vllm.general_plugins`), or is named as `module:Class`
directly (vLLM's `kv_connector_module_path` is the model): either way no file here changes, and
the built-in names cannot be taken. An engine whose module or a library it imports is not
installed is refused by name, with the missing module and the set-up step that installs it;
`check_engine` (a launcher's check before it starts anything) also asks the engine's declared
`check_installed()`, for what an engine runs outside this interpreter (vLLM's environment).
"""

from __future__ import annotations

import importlib
from typing import cast

from pdserve_worker.engines.base import LAYER_SHARDS, TENSOR_PARALLEL, Engine, EngineError, EngineLoad, EngineType

ENGINES: dict[str, str] = {
    "native": "pdserve_worker.engines.native:NativeEngine",  # pdserve's torch engine (model/)
    "vllm": "pdserve_worker.engines.vllm.engine:VllmEngine",  # vLLM with pdserve's KV connector
}
DEFAULT = "native"
# The step that installs what an engine needs (named when an import of it fails).
SETUP: dict[str, str] = {"native": "bash scripts/setup.sh", "vllm": "bash scripts/setup.sh --engine vllm"}


ENTRY_POINTS = "pdserve.engines"  # the entry-point group an engine package registers in


def installed_engines() -> dict[str, str]:
    """name -> module:Class of the engines installed packages register (their entry points)."""
    from importlib.metadata import entry_points  # (read when asked: a package may come later)

    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINTS) if ep.name not in ENGINES}


def _target(name: str) -> str:
    installed = {} if name in ENGINES else installed_engines()
    target = ENGINES.get(name) or installed.get(name) or (name if ":" in name else None)
    if target is None:
        known = sorted({*ENGINES, *installed})
        raise EngineError(f"engine {name!r} is not registered; expected one of {known} or module:Class")
    if ":" not in target:
        raise EngineError(f"engine {name!r} is registered as {target!r}; expected module:Class")
    return target


def _not_installed(name: str, missing: str) -> EngineError:
    """The refusal of an engine whose module, or a module it needs, is not installed."""
    fix = SETUP.get(name)
    how = f"run `{fix}`" if fix else f"install the package that provides {missing!r}"
    return EngineError(
        f"engine {name!r}: cannot import {_target(name)}: module {missing!r} is not installed; to install it {how}"
    )


def engine_type(name: str) -> EngineType:
    """The class of engine `name` (a registered name or `module:Class`)."""
    target = _target(name)
    module, _, attribute = target.partition(":")
    try:
        found = getattr(importlib.import_module(module), attribute)
    except ModuleNotFoundError as exc:  # the engine's module, or a module it imports
        raise _not_installed(name, exc.name or module) from exc
    except (ImportError, AttributeError) as exc:
        raise EngineError(f"engine {name!r}: cannot import {target}: {exc}") from exc
    return cast(EngineType, found)


def check_engine(name: str) -> None:
    """Refuse engine `name` unless it is installed: its class imports, and its
    `check_installed()` (what it runs elsewhere, e.g. vLLM's own environment) raises nothing.
    A launcher calls this before it starts any process, so a missing engine fails at once."""
    _check_installed(name, engine_type(name))


def _check_installed(name: str, kind: EngineType) -> None:
    try:
        kind.check_installed()
    except ModuleNotFoundError as exc:
        raise _not_installed(name, exc.name or "?") from exc


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
    _check_installed(name, kind)
    try:
        return kind.load(request)
    except ModuleNotFoundError as exc:  # a library the engine imports only when it loads
        raise _not_installed(name, exc.name or "?") from exc
