"""Every file path a product docstring or comment names exists (#53: names in docstrings went
stale in a move). A path is a mention with a folder in it (`decode/migration.py`); it holds if
some file of the repository ends with it. Upstream paths (vLLM's, llama.cpp's) are skipped by
their prefix; bare file names (`config.json`) are a format's, not ours, and are not checked."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("worker/pdserve_worker", "operator/pdserve_operator", "common/pdserve_common")
TREES = ("worker", "operator", "common", "proto", "tests", "benchmarks", "docs", "charts", "manifests", "scripts")
UPSTREAM = ("vllm/", "sglang/", "llama.cpp/", "ggml/", "torch/", "kopf/", "hixl/", "include/")
MENTION = re.compile(r"(?<![\w./-])((?:[\w-]+/)+[\w-]+\.(?:py|cpp|h|md|yaml|json|proto|sh|txt))\b")


def repository_files(root: Path) -> list[str]:
    files = [p.name for p in root.iterdir() if p.is_file()]
    for tree in TREES:
        files += [str(p.relative_to(root)) for p in (root / tree).rglob("*") if p.is_file()]
    return files


def stale_mentions(sources: list[Path], files: list[str], base: Path) -> list[str]:
    tails = {"/" + f for f in files} | set(files)
    stale = []
    for path in sources:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for named in MENTION.findall(line):
                if named.startswith(UPSTREAM) or named in tails or any(t.endswith("/" + named) for t in tails):
                    continue
                stale.append(f"{path.relative_to(base)}:{n}: {named}")
    return stale


def test_every_path_the_product_code_names_exists() -> None:
    sources = [p for r in PRODUCT for p in sorted((ROOT / r).rglob("*.py"))]
    assert stale_mentions(sources, repository_files(ROOT), ROOT) == []


def test_a_moved_module_named_in_a_comment_is_found(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text("# see roles/migration.py and decode/migration.py, vllm/v1/x.py, config.json\n")
    files = ["worker/pdserve_worker/decode/migration.py"]
    assert stale_mentions([tmp_path / "m.py"], files, tmp_path) == ["m.py:1: roles/migration.py"]
