"""serving/gc_heap.py: a ready worker's startup heap is exempt from later collections."""

from __future__ import annotations

import gc

from pdserve_worker.serving.gc_heap import freeze_startup_heap


class Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector can free it


def test_the_startup_heap_is_frozen_and_later_garbage_is_still_collected() -> None:
    before = gc.get_freeze_count()
    kept = [Node() for _ in range(100)]
    try:
        frozen = freeze_startup_heap()
        assert frozen == gc.get_freeze_count() > before + 100  # what was alive, the kept nodes too
        assert gc.collect() < 100  # the frozen cycles are not scanned, so not counted
        for _ in range(50):
            Node()  # cycles made after the freeze
        assert gc.collect() >= 50  # are found and freed as ever
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0
    del kept
