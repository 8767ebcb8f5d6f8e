"""Helpers shared by the chart tests: find helm, render the chart, split YAML streams.

helm comes from `scripts/install_tools.sh` (.tools/bin/helm); `scripts/generate.py` owns the
lookup and the rendering so that the tests render exactly what the generator commits.
"""

from __future__ import annotations

import importlib.util
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
    try:
        return str(generate.helm_binary())
    except FileNotFoundError as exc:
        pytest.fail(str(exc))


def render(*args: str) -> list[dict[str, Any]]:
    """The chart's objects for `helm template pdserve charts/pdserve -n pdserve-system ARGS`."""
    return docs(generate.helm_template(*args))


def docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]
