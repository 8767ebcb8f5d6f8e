"""The layout limits of issue #53, over the product code (worker/, operator/, common/): no file
over 700 lines, no class over 300, no module docstring over 15 lines, no function with more
than 7 parameters (self and cls not counted), no dated reading (those live in
benchmarks/README.md). Nothing is exempt: the last debts (the two role classes, the prefill
entry points' parameter lists) were paid by the cuts of the same issue."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROOTS = ("worker/pdserve_worker", "operator/pdserve_operator", "common/pdserve_common")
FILE_LINES, CLASS_LINES, DOC_LINES, PARAMS = 700, 300, 15, 7


def parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = node.args
    names = [*a.posonlyargs, *a.args, *a.kwonlyargs]
    count = len(names) + (a.vararg is not None) + (a.kwarg is not None)
    return count - (1 if names and names[0].arg in ("self", "cls") else 0)


def over_limits(roots: list[Path], base: Path = ROOT) -> set[tuple[str, str, str]]:
    found: set[tuple[str, str, str]] = set()
    for root in roots:
        for path in root.rglob("*.py"):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            rel, source = str(path.relative_to(base)), path.read_text()
            if source.count("\n") > FILE_LINES:
                found.add(("file", rel, ""))
            tree = ast.parse(source)
            doc = ast.get_docstring(tree, clean=False)
            if doc is not None and doc.count("\n") + 1 > DOC_LINES:
                found.add(("docstring", rel, ""))
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef) and (node.end_lineno or 0) - node.lineno + 1 > CLASS_LINES:
                    found.add(("class", rel, node.name))
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and parameters(node) > PARAMS:
                    found.add(("params", rel, node.name))
    return found


def test_the_product_code_keeps_the_layout_limits() -> None:
    found = over_limits([ROOT / r for r in ROOTS])
    assert found == set(), "over a layout limit"


def test_the_check_sees_each_limit(tmp_path: Path) -> None:
    doc = '"""' + "\n".join(["line"] * (DOC_LINES + 1)) + '"""\n'
    body = "\n".join(f"    x{i} = {i}" for i in range(CLASS_LINES))
    params = ", ".join(f"p{i}" for i in range(PARAMS + 1))
    filler = "\n" * FILE_LINES
    (tmp_path / "m.py").write_text(f"{doc}class Big:\n{body}\n\n\ndef wide(self, {params}):\n    return 1\n{filler}")
    (tmp_path / "ok.py").write_text('"""short"""\n\n\ndef narrow(self, a, b, c, d, e, f, g):\n    return 1\n')
    assert over_limits([tmp_path], base=tmp_path) == {
        ("file", "m.py", ""),
        ("docstring", "m.py", ""),
        ("class", "m.py", "Big"),
        ("params", "m.py", "wide"),
    }


DATED = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")  # a reading's date: measurements live in benchmarks/README.md


def dated_lines(roots: list[Path], base: Path = ROOT) -> list[str]:
    return [
        f"{path.relative_to(base)}:{n}"
        for root in roots
        for path in sorted(root.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if DATED.search(line)
    ]


def test_no_dated_measurement_in_the_product_code() -> None:
    """#53 item 5: docstrings and comments state contracts; a dated reading belongs in
    benchmarks/README.md, where the module names its section."""
    assert dated_lines([ROOT / r for r in ROOTS]) == []


def test_the_date_check_sees_a_dated_reading(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text('"""Fast."""\n# 31 ms, measured 2026-12-04 on an EPYC\nX = 1\n')
    (tmp_path / "ok.py").write_text('"""Fast (benchmarks/README.md)."""\nVERSION = "v1alpha2"\n')
    assert dated_lines([tmp_path], base=tmp_path) == ["m.py:2"]
