"""The package boundaries hold: what runs without a model imports no torch, and the operator
imports nothing of the worker package (it shares only pdserve_common with it).

Each check runs in a fresh interpreter: in this one, other tests have long imported torch."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = """
import json, sys
for name in {modules!r}:
    __import__(name)
print(json.dumps(sorted(sys.modules)))
"""


def imported_by(*modules: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(modules=list(modules))],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return set(json.loads(out.stdout))


@pytest.mark.parametrize(
    "module",
    [
        "pdserve_worker.api.app",
        "pdserve_worker.router.pd_backend",
        "pdserve_operator.handlers",
        "pdserve_operator.broker.server",
        "pdserve_worker.model.loading.sizing",  # `pdserve info` sizes a model it cannot run
        "pdserve_worker.model.loading.gguf_format",
        "pdserve_worker.model.layers.weight_routes",
    ],
)
def test_the_router_the_operator_and_the_broker_import_no_torch(module: str) -> None:
    loaded = imported_by(module)
    assert module in loaded  # the probe really imported it
    assert "torch" not in loaded, f"{module} pulls in torch"


def test_the_operator_and_the_common_package_import_nothing_of_the_worker() -> None:
    loaded = imported_by(
        "pdserve_operator.handlers",
        "pdserve_operator.broker.server",
        "pdserve_operator.runner",
        "pdserve_operator.config_docs",
        "pdserve_common.membership",
        "pdserve_common.channels",
        "pdserve_common.pod_env",
        "pdserve_common.kv_layout",
    )
    assert "pdserve_operator.handlers" in loaded and "pdserve_common.membership" in loaded
    worker = sorted(m for m in loaded if m.split(".")[0] == "pdserve_worker")
    assert worker == [], f"the operator imports the worker package: {worker}"


# --- the package order (docs/architecture.md; the rows and the import scan are in
# scripts/structure.py, which also draws them as docs/structure.md): a package imports only
# packages on lower rows; packages on one row are peers and import neither each other nor anything above them.
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from structure import LAYERS, MODEL_LAYERS, module_graph  # noqa: E402


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycle_among_product_modules() -> None:
    graph = module_graph()
    assert len(graph) > 150 and sum(map(len, graph.values())) > 400  # the scan really saw the tree
    assert cycles(graph) == []


def test_a_cycle_is_seen() -> None:
    """The detector itself: a two-module and a three-module ring, beside an acyclic tail."""
    ring = {"a": {"b"}, "b": {"a", "c"}, "c": set(), "x": {"y"}, "y": {"z"}, "z": {"x"}}
    assert sorted(cycles(ring)) == [["a", "b"], ["x", "y", "z"]]


def test_worker_packages_import_only_downwards() -> None:
    rank = {package: row for row, packages in enumerate(LAYERS) for package in packages}
    on_disk = {p.name for p in (ROOT / "worker" / "pdserve_worker").iterdir() if (p / "__init__.py").is_file()}
    assert on_disk == set(rank), f"a package is missing from LAYERS, or LAYERS names a gone one: {on_disk ^ set(rank)}"
    top_modules = sorted(p.name for p in (ROOT / "worker" / "pdserve_worker").glob("*.py") if p.name != "__init__.py")
    assert top_modules == [], f"modules with no package: {top_modules}"
    upward = []
    for module, targets in module_graph().items():
        parts = module.split(".")
        if parts[0] != "pdserve_worker" or len(parts) < 3:
            continue
        for target in targets:
            tparts = target.split(".")
            if tparts[0] == "pdserve_worker" and len(tparts) >= 3 and tparts[1] != parts[1]:
                if rank[tparts[1]] >= rank[parts[1]]:
                    upward.append(f"{module} -> {target}")
    assert upward == []


def test_model_parts_import_only_downwards() -> None:
    base = ROOT / "worker" / "pdserve_worker" / "model"
    rank = {part: row for row, parts in enumerate(MODEL_LAYERS) for part in parts}
    on_disk = {p.stem for p in base.iterdir() if p.name != "__init__.py" and (p.suffix == ".py" or p.is_dir())}
    on_disk.discard("__pycache__")
    assert on_disk == set(rank), (
        f"a model part is missing from MODEL_LAYERS, or it names a gone one: {on_disk ^ set(rank)}"
    )
    upward, checked = [], 0
    for module, targets in module_graph().items():
        parts = module.split(".")
        if parts[:2] != ["pdserve_worker", "model"] or len(parts) < 3:
            continue
        for target in targets:
            tparts = target.split(".")
            if tparts[:2] == ["pdserve_worker", "model"] and len(tparts) >= 3 and tparts[2] != parts[2]:
                checked += 1
                if rank[tparts[2]] >= rank[parts[2]]:
                    upward.append(f"{module} -> {target}")
    assert checked > 20  # the scan saw the arrows between the model's parts
    assert upward == []


def test_the_common_vocabulary_imports_neither_side() -> None:
    leaks = [
        f"{module} -> {target}"
        for module, targets in module_graph().items()
        for target in targets
        if (module.startswith("pdserve_common") and not target.startswith("pdserve_common"))
        or (module.startswith("pdserve_operator") and target.startswith("pdserve_worker"))
    ]
    assert leaks == []


def test_only_the_family_modules_name_a_family() -> None:
    """A family is one module of model/families plus its line in NAMES: the config reader, the
    GGUF reader and the forward decide by the family's switches, never by its name. (The
    tokenizer's GGUF pre-tokenizer names, like "qwen2", are a different vocabulary.)"""
    from pdserve_worker.model.families import NAMES

    base = ROOT / "worker" / "pdserve_worker" / "model"
    sources = [base / "config.py", base / "shapes.py", base / "engine.py", *base.glob("layers/*.py")]
    sources += [p for p in base.glob("loading/*.py")]
    named = []
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in NAMES:
                named.append(f"{path.relative_to(base)}:{node.lineno} {node.value!r}")
    assert len(sources) > 15
    # The one default, twice: a model without a model_type is read as LLaMA (the dataclass field,
    # and a config.json that leaves the key out).
    defaults = ['architecture: str = "llama"', 'data.get("model_type", "llama")']
    lines = (base / "config.py").read_text().splitlines()
    allowed = [f"config.py:{i} 'llama'" for i, line in enumerate(lines, 1) if any(d in line for d in defaults)]
    assert len(allowed) == 2 and named == allowed


SOURCE_ROOTS = {
    "pdserve_worker": "worker",
    "pdserve_operator": "operator",
    "pdserve_common": "common",
    "pdserve": "proto",
}


def module_exists(root: Path, name: str) -> bool:
    top = name.split(".")[0]
    if top not in SOURCE_ROOTS:
        return True  # not ours
    base = root / SOURCE_ROOTS[top] / Path(*name.split("."))
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def test_every_import_of_our_modules_names_one_that_exists() -> None:
    """mypy checks only some packages, so a module moved away under an unchecked importer was
    found only when the suite's collection failed (decode/generation_loop.py importing
    serving.tp_group after ranks/ took it)."""
    root = Path(__file__).resolve().parents[2]
    missing, seen = [], 0
    for folder in ("worker/pdserve_worker", "operator/pdserve_operator", "common/pdserve_common"):
        for path in (root / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module]
                elif isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                for name in names:
                    seen += name.split(".")[0] in SOURCE_ROOTS
                    if not module_exists(root, name):
                        missing.append(f"{path.relative_to(root)}:{node.lineno} imports {name}")
    assert seen > 500, f"only {seen} imports of our modules found: is the walk looking in the right place?"
    assert not missing, "imports of modules that do not exist:\n" + "\n".join(missing)
