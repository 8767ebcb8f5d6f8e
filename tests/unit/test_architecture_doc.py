"""docs/architecture.md names modules and their classes and functions hop by hop; each name must
exist, so that a move or a rename that forgets the document fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
BASES = [
    ROOT / "worker" / "pdserve_worker",
    ROOT / "operator" / "pdserve_operator",
    ROOT / "common" / "pdserve_common",
    ROOT / "operator",
    ROOT / "common",
    ROOT / "worker",
    ROOT,
]
# `prefill/worker.py`, `kv/slots.SlotTable`, `router/pd_backend.PDBackend.generate`, `model/layers/llama.LlamaModel.prefill_batch`
NAMED = re.compile(r"`((?:[a-z_]+/)*[a-z_]+)(?:\.py|\.([A-Za-z_][\w.]*))`")


def resolve(path: str) -> Path | None:
    for base in BASES:
        for candidate in (base / f"{path}.py", base / path / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def test_every_module_and_name_the_architecture_names_exists() -> None:
    named = NAMED.findall(DOC.read_text())
    assert len(named) > 30  # the document really names its hops
    missing = []
    for path, attrs in named:
        if path == "pyproject":  # `pyproject.toml`, not a module
            continue
        source = resolve(path)
        if source is None:
            missing.append(f"{path} (no module)")
            continue
        text = source.read_text()
        for attr in filter(None, (attrs or "").split(".")):
            if not re.search(
                rf"^\s*(?:async\s+def|def|class)\s+{re.escape(attr)}\b|^{re.escape(attr)}\s*[:=]", text, re.M
            ):
                missing.append(f"{path}.{attr} (not defined in {source.relative_to(ROOT)})")
    assert missing == []


def test_the_readme_points_to_it() -> None:
    assert "docs/architecture.md" in (ROOT / "README.md").read_text()
