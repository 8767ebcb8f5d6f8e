import mmap

import pytest
import torch

from pdserve_common.kv_layout import K, KVLayout, V
from pdserve_worker.kv.cache import KVCache, dtype_name, torch_dtype


def layout(**kw) -> KVLayout:
    base = dict(num_slots=3, num_layers=2, max_len=8, kv_heads=2, head_dim=4, dtype="float32")
    base.update(kw)
    return KVLayout(**base)


def test_allocate_gives_a_zeroed_pool_of_the_layout_shape():
    cache = KVCache.allocate(layout(dtype="bfloat16"))
    assert cache.tensor.shape == (3, 2, 2, 8, 2, 4)
    assert cache.tensor.dtype == torch.bfloat16
    assert not cache.tensor.any()


def test_wraps_memory_it_does_not_own_and_writes_land_at_layout_offsets():
    lay = layout()
    buf = mmap.mmap(-1, lay.total_bytes)  # stands in for the transfer engine's shared memory
    tensor = torch.frombuffer(buf, dtype=torch.float32).view(lay.shape)
    cache = KVCache(lay, tensor)
    assert cache.tensor.data_ptr() == tensor.data_ptr()

    cache.values(1)[2, 5] = 7.0  # slot 2, layer 1, V, token 5
    offset, length = lay.token_run(2, 1, V, 1, start_token=5)
    raw = torch.frombuffer(buf, dtype=torch.uint8)[offset : offset + length]
    assert torch.equal(raw.view(torch.float32), torch.full((8,), 7.0))
    assert torch.count_nonzero(torch.frombuffer(buf, dtype=torch.float32)) == 8


def test_a_pool_holding_a_layer_range_is_indexed_by_model_layer():
    lay = layout(first_layer=4)
    cache = KVCache.allocate(lay)
    cache.keys(5)[0, 0] = 1.0
    offset = lay.offset(0, 5, K)
    flat = cache.tensor.view(-1)
    assert flat[offset // 4] == 1.0
    with pytest.raises(IndexError, match="layer 3 not held"):
        cache.keys(3)
    with pytest.raises(IndexError, match="layer 6 not held"):
        cache.values(6)


@pytest.mark.parametrize(
    "tensor, message",
    [
        (torch.zeros(3, 2, 2, 8, 2, 5), "shape"),
        (torch.zeros(3, 2, 2, 8, 2, 4, dtype=torch.float16), "dtype"),
        (torch.zeros(3, 2, 2, 8, 4, 2).transpose(-1, -2), "contiguous"),
    ],
)
def test_rejects_a_tensor_that_does_not_fit_the_layout(tensor, message):
    with pytest.raises(ValueError, match=message):
        KVCache(layout(), tensor)


def test_clear_slot_zeroes_only_that_slot():
    cache = KVCache.allocate(layout())
    cache.tensor.fill_(1.0)
    cache.clear_slot(1)
    assert not cache.slot(1).any()
    assert cache.slot(0).all() and cache.slot(2).all()
    with pytest.raises(IndexError, match="slot 3"):
        cache.slot(3)


def test_dtype_names_round_trip():
    for name in ("float32", "float16", "bfloat16"):
        assert dtype_name(torch_dtype(name)) == name
    with pytest.raises(ValueError, match="int8"):
        torch_dtype("int8")
