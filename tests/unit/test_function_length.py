"""No product function over 60 lines (nano-vllm's longest is 55): long coroutines hid request
state in their locals. Declared tables are the exception, each named here with why."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 60
# A constructor that only declares Prometheus metrics, one per statement: a table, not logic.
TABLES = {
    ("worker/pdserve_worker/api/metrics.py", "__init__"),
    ("worker/pdserve_worker/serving/worker_metrics.py", "__init__"),
}


def long_functions(roots: list[Path], base: Path = ROOT) -> list[tuple[str, str, int]]:
    found = []
    for root in roots:
        for path in root.rglob("*.py"):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    length = (node.end_lineno or node.lineno) - node.lineno + 1
                    if length > LIMIT:
                        found.append((str(path.relative_to(base)), node.name, length))
    return found


def test_no_product_function_is_over_60_lines() -> None:
    roots = [
        ROOT / "worker" / "pdserve_worker",
        ROOT / "operator" / "pdserve_operator",
        ROOT / "common" / "pdserve_common",
    ]
    found = long_functions(roots)
    tables = {(path, name) for path, name, _ in found if (path, name) in TABLES}
    assert tables == TABLES, "a declared table is gone or short now: drop it from TABLES"
    assert [f for f in found if (f[0], f[1]) not in TABLES] == []


def test_the_check_sees_a_long_function(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT))
    (tmp_path / "m.py").write_text(f"def short():\n    return 1\n\n\ndef long():\n{body}\n")
    assert long_functions([tmp_path], base=tmp_path) == [("m.py", "long", LIMIT + 1)]
