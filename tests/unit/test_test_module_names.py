"""Test modules are collected by basename (the test folders are not packages), so two test files
with one name stop the whole suite at collection: `.ci/run` failed that way once, with
tests/unit/ and tests/e2e/ each holding test_disaggregated_set.py."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_module_name_is_unique_across_the_suite() -> None:
    by_name: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        by_name[path.name].append(str(path.relative_to(TESTS)))
    clashes = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not clashes, f"test module names used twice (pytest refuses to collect them): {clashes}"
    assert len(by_name) > 100, f"found only {len(by_name)} test modules under {TESTS}"
