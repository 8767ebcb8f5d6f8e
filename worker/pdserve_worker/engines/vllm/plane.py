"""A vLLM worker's end of pdserve's KV plane: its transfer engine with vLLM's KV cache registered.

Both worker sides start it from `register_kv_caches`: the engine by name from pdserve's
transfer registry (the host engine on CPU, real HIXL where CANN is: nothing here is CPU-only),
initialized the way a pdserve worker does (`service_link`: a decode listens and takes writes
only into leased ranges, a prefill only connects out; both hold the link key), then each
layer's planes registered whole (host memory for CPU tensors, device memory otherwise), before
any peer connects. `close` deregisters and finalizes; it is the one release path.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from pdserve_common.logs import kv
from pdserve_worker.engines.vllm.grant import ConnectorSettings, KVGeometry
from pdserve_worker.transfer.base import TransferBackend, TransferError
from pdserve_worker.transfer.registry import create_engine
from pdserve_worker.transfer.service_link import engine_options

log = logging.getLogger(__name__)


class KVPlane:
    """The engine, the geometry of the registered cache and the registration handles."""

    def __init__(self, settings: ConnectorSettings, role: str) -> None:
        if role not in ("prefill", "decode"):
            raise ValueError(f"KV plane role must be 'prefill' or 'decode', got {role!r}")
        if role == "decode" and not settings.listen:
            raise ValueError("a decode's connector needs pdserve_listen ('ip:port' its transfer engine listens on)")
        if not settings.link_key:
            raise ValueError(
                "the connector needs $PDSERVE_KV_LINK_KEY or pdserve_link_key (hex): the KV plane admits only its holders"
            )
        self.settings = settings
        self.role = role
        self.backend: TransferBackend | None = None
        self.geometry: KVGeometry | None = None
        self.engine_id = ""
        self._handles: list[int] = []

    def open(self, kv_caches: Mapping[str, Any], block_tokens: int) -> KVGeometry:
        """Start the engine and register every layer's planes; returns the geometry."""
        geometry = KVGeometry.of(kv_caches, block_tokens)
        backend = create_engine(self.settings.backend)
        api = backend.api
        engine_id = self.settings.listen if self.role == "decode" else _client_id(self.settings)
        options = engine_options(backend.name, bytes.fromhex(self.settings.link_key), {}, self.role == "decode")
        backend.check(backend.engine.initialize(engine_id, options), f"initialize transfer engine {engine_id}")
        self.backend, self.engine_id = backend, engine_id
        device = next(iter(kv_caches.values())).device.type
        mem_type = api.MemType.MEM_HOST if device == "cpu" else api.MemType.MEM_DEVICE
        try:
            for planes in geometry.planes:
                for base in planes:
                    nbytes = geometry.num_blocks * geometry.block_stride
                    status, handle = backend.engine.register_mem(api.MemDesc(base, nbytes), mem_type)
                    if status != api.SUCCESS:
                        raise TransferError(f"register_mem of a KV plane ({nbytes} bytes at {base:#x})", status)
                    self._handles.append(handle)
        except BaseException:
            self.close()
            raise
        self.geometry = geometry
        log.info(
            kv(
                event="vllm_kv_registered",
                role=self.role,
                engine=engine_id,
                backend=backend.name,
                layers=len(geometry.layer_names),
                blocks=geometry.num_blocks,
                block_bytes=geometry.block_bytes,
                device=device,
            )
        )
        return geometry

    def close(self) -> None:
        backend, self.backend = self.backend, None
        if backend is None:
            return
        for handle in self._handles:
            backend.engine.deregister_mem(handle)
        self._handles.clear()
        backend.engine.finalize()


def _client_id(settings: ConnectorSettings) -> str:
    """A prefill connects out only: HIXL's client id is an address without a port."""
    host = settings.listen.rpartition(":")[0] if settings.listen else ""
    return host or "127.0.0.1"
