"""Real HIXL, from CANN (`import hixl`): the engine this project is built for (HIXL.md). Its
pools may lie in NPU memory, so pushed KV carries the device-side FLETCHER64 digest
(transfer/device_digest.py), not XXH3 over host addresses."""

from __future__ import annotations

import importlib

from pdserve_worker.transfer.base import FLETCHER64, BackendUnavailable, TransferBackend


def create() -> TransferBackend:
    try:
        module = importlib.import_module("hixl")
    except (ImportError, OSError) as exc:  # no CANN: the .so or its ACL libraries are missing
        raise BackendUnavailable(f"`import hixl` failed (is CANN installed?): {exc!r}") from exc
    return TransferBackend("hixl", module.Hixl(), module, digest=FLETCHER64)
