"""The engine seam of issue #53, held statically: the roles and the rank groups (prefill/,
decode/, ranks/, process/) reach a model only through engines/base.py. None of them names the
native engine or its model (`NativeEngine`, `native_of`, `LlamaModel`), builds a KV cache
itself (`KVCache(...)`, `PagedKVCache(...)`: `Engine.bind_pool` makes it), or reads the
`.model` of an engine; a group takes the engine's group operations (`GroupEngine`) by its
declared capabilities (`group_engine`)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("prefill", "decode", "ranks", "process")
NATIVE_NAMES = frozenset({"NativeEngine", "native_of", "LlamaModel"})
CACHES = frozenset({"KVCache", "PagedKVCache"})


def _name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def crossings(source: str) -> set[tuple[str, str]]:
    """(what, name) for each way `source` goes past the engine seam."""
    found: set[tuple[str, str]] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom | ast.Import):
            found |= {("names", a.name) for a in node.names if a.name.rsplit(".", 1)[-1] in NATIVE_NAMES}
        elif (name := _name(node)) in NATIVE_NAMES:
            found.add(("names", str(name)))
        if isinstance(node, ast.Call) and _name(node.func) in CACHES:
            found.add(("builds", str(_name(node.func))))
        if isinstance(node, ast.Attribute) and node.attr == "model" and "engine" in ast.unparse(node.value).lower():
            found.add(("reaches", ast.unparse(node)))
    return found


def test_the_roles_and_groups_reach_the_model_only_through_the_engine_protocol() -> None:
    found = {
        (str(path.relative_to(ROOT)), *crossing)
        for package in PACKAGES
        for path in sorted((ROOT / "worker/pdserve_worker" / package).rglob("*.py"))
        for crossing in crossings(path.read_text())
    }
    assert found == set(), "past the engine seam (engines/base.py declares what a role may use)"


def test_the_check_sees_each_crossing() -> None:
    crossing = """
from pdserve_worker.engines.native import NativeEngine, native_of
from pdserve_worker.model.layers import llama
def f(engine, layout, memory):
    llama.LlamaModel
    cache = KVCache(layout, memory)
    paged = kv.PagedKVCache(layout, memory)
    native_of(engine).model.layer_range
    return engine.model, self.engine.model.device
"""
    assert crossings(crossing) == {
        ("names", "NativeEngine"),
        ("names", "native_of"),
        ("names", "LlamaModel"),
        ("builds", "KVCache"),
        ("builds", "PagedKVCache"),
        ("reaches", "native_of(engine).model"),
        ("reaches", "engine.model"),
        ("reaches", "self.engine.model"),
    }
    clean = """
from pdserve_worker.engines.base import LAYER_SHARDS, group_engine
from pdserve_worker.kv.cache import KVCache
def f(engine, layout, memory, loaded) -> KVCache:
    member = group_engine(engine, LAYER_SHARDS)
    self.model.idle(); loaded.model
    return member.bind_pool(layout, memory)
"""
    assert crossings(clean) == set()
