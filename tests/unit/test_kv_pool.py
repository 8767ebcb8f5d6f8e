"""The KV pool: one registered allocation, seen as a tensor of `layout.shape` and as raw bytes."""

from __future__ import annotations

import ctypes
from typing import Any

import pytest

from pdserve_common.kv_layout import KVLayout, V
from pdserve_worker.transfer.base import TransferBackend, TransferError
from pdserve_worker.transfer.pool import KVPool
from pdserve_worker.transfer.registry import create_engine

torch = pytest.importorskip("torch")

LAYOUT = KVLayout(num_slots=2, num_layers=3, max_len=8, kv_heads=2, head_dim=4, dtype="bfloat16", first_layer=1)


@pytest.fixture
def backend() -> Any:
    b = create_engine("cpu")
    b.check(b.engine.initialize("127.0.0.1"), "initialize")
    yield b
    b.engine.finalize()


def test_tensor_and_raw_offsets_are_one_memory(backend: TransferBackend) -> None:
    pool = KVPool(backend, LAYOUT)
    try:
        t = pool.tensor
        assert tuple(t.shape) == LAYOUT.shape and t.dtype == torch.bfloat16
        assert t.data_ptr() == pool.base_addr and pool.nbytes == LAYOUT.total_bytes
        assert t.abs().sum().item() == 0  # zero-filled
        t[1, 2, V, 3] = 1.5  # slot 1, model layer 3 (local index 2), V, token 3
        addr, length = pool.run(1, 3, V, 1, start_token=3)
        raw = torch.frombuffer(bytearray(ctypes.string_at(addr, length)), dtype=torch.bfloat16)
        assert raw.tolist() == [1.5] * 8
        pool.warm(1, 4)  # touches pages; must not fault or change anything
        assert t[1, 2, V, 3, 1, 3].item() == 1.5
    finally:
        pool.close()


class NoAllocator:
    """Real HIXL has no malloc_mem: the pool is then a torch allocation, registered as is."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.registered: list[tuple[int, int, int]] = []

    def register_mem(self, desc: Any, mem_type: int) -> Any:
        self.registered.append((desc.addr, desc.len, int(mem_type)))
        return self._engine.register_mem(desc, mem_type)

    def deregister_mem(self, handle: int) -> int:
        return self._engine.deregister_mem(handle)


def test_without_an_engine_allocator_the_pool_is_a_registered_torch_tensor(backend: TransferBackend) -> None:
    wrapped = NoAllocator(backend.engine)
    plain = TransferBackend("hixl", wrapped, backend.api)
    assert plain.host is None
    pool = KVPool(plain, LAYOUT)
    try:
        assert wrapped.registered == [(pool.tensor.data_ptr(), LAYOUT.total_bytes, int(backend.api.MemType.MEM_HOST))]
        assert pool.base_addr == pool.tensor.data_ptr()
    finally:
        pool.close()


def test_a_failed_registration_raises_and_frees(backend: TransferBackend) -> None:
    backend.engine.finalize()  # every call now answers FAILED
    with pytest.raises(TransferError, match="FAILED"):
        KVPool(backend, LAYOUT)
