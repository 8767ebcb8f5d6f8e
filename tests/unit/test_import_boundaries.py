"""The package boundaries hold: what runs without a model imports no torch, and the operator
imports nothing of the worker package (it shares only pdserve_common with it).

Each check runs in a fresh interpreter: in this one, other tests have long imported torch."""

from __future__ import annotations

import json
import subprocess
import sys

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
        "pdserve_operator.broker",
    ],
)
def test_the_router_the_operator_and_the_broker_import_no_torch(module: str) -> None:
    loaded = imported_by(module)
    assert module in loaded  # the probe really imported it
    assert "torch" not in loaded, f"{module} pulls in torch"


def test_the_operator_and_the_common_package_import_nothing_of_the_worker() -> None:
    loaded = imported_by(
        "pdserve_operator.handlers",
        "pdserve_operator.broker",
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
