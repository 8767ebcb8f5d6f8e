"""A decode (or prefill) KV pool: one allocation per `KVLayout`, registered with the engine once.

One contiguous tensor of `layout.shape`: a remote writer needs only its base address and the
layout to find any (slot, layer, K|V, token). Registered before any peer connects (HIXL's rule)
and kept while the process serves. Its memory:
- host engine: the engine's shared memory (`malloc_mem`), so a prefill on the same host writes
  it with a memcpy; the tensor is a `torch.frombuffer` view of it.
- real HIXL on an NPU: a device tensor registered as MEM_DEVICE (HCCS wants 2 MB-aligned
  pages, which the NPU caching allocator gives for allocations this large).
- real HIXL without a device: a host tensor registered as MEM_HOST.
torch is imported only when `.tensor` is first used (raw-byte users do not pay for it).
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from typing import Any

from pdserve_common.kv_layout import K, KVLayout, V, block_spans
from pdserve_common.logs import kv
from pdserve_worker.transfer.base import FLETCHER64, TransferBackend, TransferError

log = logging.getLogger(__name__)

PAGE = 4096


class KVPool:
    """Allocated and registered on construction; `close()` deregisters and frees it."""

    def __init__(self, backend: TransferBackend, layout: KVLayout, device: str = "cpu") -> None:
        self.layout = layout
        self.device = device
        self._backend = backend
        self._owned_tensor: Any = None  # keeps a torch-allocated pool alive
        self._tensor: Any = None
        self._malloced = False
        api = backend.api
        nbytes = layout.total_bytes
        if device == "cpu" and backend.host is not None:
            status, addr = backend.host.malloc_mem(nbytes, api.MemType.MEM_HOST)
            backend.check(status, f"malloc_mem({nbytes}) for KV pool {layout}")
            self._malloced = True
            self.mem_type = api.MemType.MEM_HOST
        else:
            torch = _torch()
            self._owned_tensor = torch.zeros(layout.shape, dtype=getattr(torch, layout.dtype), device=device)
            addr = int(self._owned_tensor.data_ptr())
            self.mem_type = api.MemType.MEM_HOST if device == "cpu" else api.MemType.MEM_DEVICE
        self.base_addr: int = addr
        self.nbytes: int = nbytes
        status, handle = backend.engine.register_mem(api.MemDesc(addr, nbytes), self.mem_type)
        if status != api.SUCCESS:
            self._free()
            raise TransferError(f"register_mem of KV pool ({nbytes} bytes at {addr:#x})", status)
        self.handle: int = handle
        self._digested = backend.digest == FLETCHER64  # found by address by device_digest.py
        if self._digested:
            from pdserve_worker.transfer import device_digest

            device_digest.register(self.tensor)
        log.info(
            kv(
                event="kv_pool_registered",
                backend=backend.name,
                device=device,
                bytes=nbytes,
                slots=layout.num_slots,
                layers=f"{layout.first_layer}..{layout.layer_range.stop - 1}",
                base=hex(addr),
            )
        )

    @property
    def tensor(self) -> Any:
        """The pool as a torch tensor of `layout.shape` (a view of the registered memory)."""
        if self._tensor is None:
            if self._owned_tensor is not None:
                self._tensor = self._owned_tensor
            else:
                torch = _torch()
                raw = (ctypes.c_char * self.nbytes).from_address(self.base_addr)
                flat = torch.frombuffer(raw, dtype=getattr(torch, self.layout.dtype))
                self._tensor = flat.view(self.layout.shape)
        return self._tensor

    def run(self, slot: int, layer: int, kv_index: int, num_tokens: int, start_token: int = 0) -> tuple[int, int]:
        """(address, length) of one (slot, layer, K|V) token run in this process."""
        offset, length = self.layout.token_run(slot, layer, kv_index, num_tokens, start_token)
        return self.base_addr + offset, length

    def warm(self, slot: int, num_tokens: int) -> None:
        """Touch one byte per page of a slot's first `num_tokens` tokens, so the first decode
        step does not take page faults or cold TLB misses on KV that arrived by DMA/memcpy."""
        if self.device != "cpu" or num_tokens <= 0:
            return
        import numpy as np

        for layer in self.layout.layer_range:
            for kv_index in (K, V):
                addr, length = self.run(slot, layer, kv_index, num_tokens)
                view = np.ctypeslib.as_array((ctypes.c_uint8 * length).from_address(addr))
                int(view[::PAGE].sum())

    def warm_blocks(self, blocks: Sequence[int]) -> None:
        """`warm` for a paged pool: touch one byte per page of `blocks` in every layer."""
        if self.device != "cpu" or not blocks:
            return
        import numpy as np

        for offset, length in block_spans(self.layout.blocks, blocks):
            view = np.frombuffer(
                memoryview((ctypes.c_char * length).from_address(self.base_addr + offset)), dtype=np.uint8
            )
            int(view[::PAGE].sum())

    def close(self) -> None:
        """Deregister and free. Only at shutdown: the tensor view must not be used after this.

        A process whose engine listens should rather `deregister()`, finalize the engine (its
        server stops, so no peer's write can still be landing), then `free()`."""
        self.deregister()
        self.free()

    def deregister(self) -> None:
        """No new link or transfer may reach the pool (HIXL: deregister before finalize)."""
        if self.handle:
            self._backend.engine.deregister_mem(self.handle)
            self.handle = 0

    def free(self) -> None:
        """Release the memory. After the engine is finalized the host engine has already
        unmapped what it allocated; freeing is then a no-op."""
        if self._digested:
            from pdserve_worker.transfer import device_digest

            device_digest.unregister(self.tensor)
            self._digested = False
        self._tensor = None
        self._free()

    def _free(self) -> None:
        freed = self._malloced or self._owned_tensor is not None
        if self._malloced and self._backend.host is not None:
            self._backend.host.free_mem(self.base_addr)
            self._malloced = False
        self._owned_tensor = None
        if freed:
            log.info(kv(event="kv_pool_freed", bytes=self.nbytes))


def _torch() -> Any:
    import torch

    return torch
