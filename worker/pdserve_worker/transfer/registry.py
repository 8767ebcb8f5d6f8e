"""The transfer backends by name: a new backend is one module with a `create()` and one line here.

Each entry names the module and factory that makes its `TransferBackend`; the module is
imported only when that backend is asked for, so a process that never uses the two-sided
baseline never imports gloo, and one without CANN never tries `import hixl` unless "auto" or
"hixl" asks it to. A factory raises `BackendUnavailable` when its engine cannot run here.
(vLLM's KVConnectorFactory is the model: names to lazily imported classes.)
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import cast

from pdserve_common.logs import kv
from pdserve_worker.transfer.base import BackendUnavailable, TransferBackend

log = logging.getLogger(__name__)

BACKENDS: dict[str, str] = {
    "hixl": "pdserve_worker.transfer.backends.hixl:create",  # real HIXL (CANN)
    "cpu": "pdserve_worker.transfer.backends.host.engine:create",  # the host engine, same API
    "two-sided": "pdserve_worker.transfer.backends.two_sided:create",  # gloo send/recv: seed 002's baseline
}
# "auto": the first of these that can run here.
AUTO = ("hixl", "cpu")
NAMES: tuple[str, ...] = ("auto", *BACKENDS)


def _factory(name: str) -> Callable[[], TransferBackend]:
    module, _, function = BACKENDS[name].partition(":")
    return cast(Callable[[], TransferBackend], getattr(importlib.import_module(module), function))


def create_engine(backend: str = "auto") -> TransferBackend:
    """An uninitialised engine: the caller runs `engine.initialize("ip:port", options)`.

    "auto" takes real HIXL when `import hixl` works and the host engine otherwise; any other
    name insists on that backend (BackendUnavailable when it cannot run here).
    """
    if backend not in NAMES:
        raise ValueError(f"transfer backend must be one of {', '.join(NAMES)}, got {backend!r}")
    for name in AUTO if backend == "auto" else (backend,):
        try:
            made = _factory(name)()
        except BackendUnavailable as exc:
            if backend != "auto":
                raise BackendUnavailable(f"transfer backend {name!r} requested but {exc}") from exc
            log.info(kv(event="transfer_backend_unavailable", backend=name, error=exc))
            continue
        log.info(kv(event="transfer_backend", backend=made.name, requested=backend))
        return made
    raise BackendUnavailable(f"no transfer backend of {AUTO} can run here")
