"""Pick the transfer engine: real HIXL where CANN is installed, the host engine elsewhere.

Code above this module never imports `hixl` or `host_engine` itself. It gets a
`TransferBackend`: the engine instance plus `api`, the module that holds the descriptor types,
enums and status codes that this engine accepts (the real `hixl` module, or our mirror
`hixl_api`), and writes `backend.api.TransferOpDesc(...)`, `backend.api.SUCCESS`, ... so that
one and the same code drives both.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

from pdserve_worker.logs import kv
from pdserve_worker.transfer import hixl_api

log = logging.getLogger("pdserve.transfer.engine")

BackendName = Literal["auto", "hixl", "cpu"]


class TransferError(RuntimeError):
    """A transfer-engine call returned a status other than the ones the caller accepts."""

    def __init__(self, what: str, status: int) -> None:
        super().__init__(f"{what}: {hixl_api.status_name(status)}")
        self.status = status


@dataclass
class TransferBackend:
    """A transfer engine and the vocabulary (types, enums, codes) that goes with it."""

    name: Literal["hixl", "cpu"]
    engine: Any  # hixl.Hixl or host_engine.Hixl: the same methods
    api: ModuleType

    @property
    def has_allocator(self) -> bool:
        """Whether the engine allocates memory peers can share (the host engine's malloc_mem)."""
        return hasattr(self.engine, "malloc_mem")

    @property
    def can_block_on_notifies(self) -> bool:
        """Whether readiness can sleep in the engine (host engine) or must poll (real HIXL)."""
        return hasattr(self.engine, "wait_notifies")

    def check(self, status: int, what: str, *accept: int) -> None:
        """Raise TransferError unless `status` is SUCCESS or one of `accept`."""
        if status != self.api.SUCCESS and status not in accept:
            raise TransferError(what, status)

    def ensure_connected(self, remote_engine: str, timeout_ms: int) -> None:
        status = self.engine.connect(remote_engine, timeout_ms)
        self.check(status, f"connect to {remote_engine}", self.api.ALREADY_CONNECTED)


def _load_hixl() -> ModuleType | None:
    try:
        return importlib.import_module("hixl")
    except (ImportError, OSError) as exc:  # no CANN: the .so or its ACL libraries are missing
        log.info(kv(event="hixl_unavailable", error=exc))
        return None


def create_engine(backend: BackendName = "auto") -> TransferBackend:
    """An uninitialised engine: the caller runs `engine.initialize("ip:port", options)`.

    "auto" takes real HIXL when `import hixl` works and the host engine otherwise; "hixl"
    insists on real HIXL; "cpu" always takes the host engine.
    """
    if backend not in ("auto", "hixl", "cpu"):
        raise ValueError(f"transfer backend must be auto, hixl or cpu, got {backend!r}")
    if backend in ("auto", "hixl"):
        module = _load_hixl()
        if module is not None:
            log.info(kv(event="transfer_backend", backend="hixl", requested=backend))
            return TransferBackend("hixl", module.Hixl(), module)
        if backend == "hixl":
            raise RuntimeError("transfer backend 'hixl' requested but `import hixl` failed (is CANN installed?)")
    from pdserve_worker.transfer.host_engine import Hixl as HostHixl

    log.info(kv(event="transfer_backend", backend="cpu", requested=backend))
    return TransferBackend("cpu", HostHixl(), hixl_api)
