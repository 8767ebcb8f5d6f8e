"""Loggers are named for their module (`logging.getLogger(__name__)`, issue #53), so a log line's
`logger=` says where it came from and levels can be set per package. The exceptions configure
logging rather than log: the root logger's handler (pdserve_common/logs.py), a process's own
logger (`pdserve.<process>`, logs.setup's return) and the vLLM connector's handler on our package
inside a vLLM server (engines/vllm/connector.py)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROOTS = ("worker/pdserve_worker", "operator/pdserve_operator", "common/pdserve_common")
CONFIGURERS = {
    ("common/pdserve_common/logs.py", ""),
    ("common/pdserve_common/logs.py", "f'pdserve.{process}'"),
    ("worker/pdserve_worker/engines/vllm/connector.py", "'pdserve_worker'"),
}


def logger_calls(base: Path = ROOT) -> list[tuple[str, str]]:
    """(file, the argument as written) of every logging.getLogger(...) call in the product code."""
    found = []
    for folder in ROOTS:
        for path in (base / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and ast.unparse(node.func) == "logging.getLogger":
                    argument = ast.unparse(node.args[0]) if node.args else ""
                    found.append((str(path.relative_to(base)), argument))
    return found


def test_every_module_logger_is_named_for_its_module() -> None:
    calls = logger_calls()
    assert len(calls) > 50, f"only {len(calls)} getLogger calls found: is the walk looking in the right place?"
    others = {call for call in calls if call[1] != "__name__"}
    assert others == CONFIGURERS, f"loggers not named __name__: {sorted(others - CONFIGURERS)}"
