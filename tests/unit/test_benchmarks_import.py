"""Every benchmark script imports: a move of a module they use (tests/support/local_run.py moved
from tests/integration once, and two benchmarks broke unseen) fails here, not on the next run.

One fresh interpreter imports them all as their own directory would (`python benchmarks/x.py`
puts benchmarks/ first on sys.path); their `main` is not run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import importlib, json, sys
sys.path.insert(0, {benchmarks!r})
failed = {{}}
for name in {names!r}:
    try:
        importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001
        failed[name] = repr(exc)
print(json.dumps(failed))
"""


def test_every_benchmark_script_imports() -> None:
    names = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py"))
    assert len(names) > 10 and "soak" in names and "migrate" in names
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(benchmarks=str(ROOT / "benchmarks"), names=names)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {}
