"""Keep the garbage collector off the startup heap once a worker is ready to serve.

CPython's full collections walk every tracked object, and a loaded worker holds millions of
them (torch, the model's modules, gRPC, the tokenizer) that live for ever. Serving allocates
in bursts (a tensor-parallel rank's head-sliced push makes 100,000 transfer descriptors per
prompt), and each burst that survives a young collection brings a full one nearer (a large
share of such a push's time: benchmarks/README.md, "Model measurements behind the module
docstrings"). vLLM does the
same after its engine starts (v1 EngineCore: `gc.collect()` then `gc.freeze()`): objects alive
at that point move to a permanent generation the collector no longer scans. Garbage made later
is collected as before; only the startup heap is exempt (and is never garbage: it is the
worker).
"""

from __future__ import annotations

import gc
import logging
import time

from pdserve_common.logs import kv

log = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect once, then exempt every object alive now from later collections; returns how many."""
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info(kv(event="gc_heap_frozen", objects=frozen, ms=round((time.perf_counter() - started) * 1e3, 1)))
    return frozen
