import pytest

from pdserve_common.kv_layout import K, KVLayout, V, shard_layers


def make(**kw):
    base = dict(num_slots=4, num_layers=3, max_len=16, kv_heads=2, head_dim=8, dtype="float32")
    base.update(kw)
    return KVLayout(**base)


def test_offsets_follow_the_design_formula():
    lay = make()
    per = 16 * 2 * 8 * 4
    assert lay.bytes_per_kv_layer == per
    for slot in range(4):
        for layer in range(3):
            for kv in (K, V):
                assert lay.offset(slot, layer, kv) == ((slot * 3 + layer) * 2 + kv) * per


def test_runs_of_all_slots_tile_the_pool_without_overlap():
    lay = make()
    spans = sorted(lay.token_run(s, layer, kv, lay.max_len) for s in range(4) for layer in range(3) for kv in (K, V))
    pos = 0
    for off, length in spans:
        assert off == pos
        pos += length
    assert pos == lay.total_bytes


def test_prompt_prefix_is_one_contiguous_run():
    lay = make()
    off, length = lay.token_run(2, 1, V, 5)
    assert off == lay.offset(2, 1, V)
    assert length == 5 * lay.bytes_per_token
    off2, _ = lay.token_run(2, 1, V, 1, start_token=5)
    assert off2 == off + length


def test_sharded_pool_holds_only_its_layers():
    lay = make(num_layers=2, first_layer=4)
    assert lay.offset(0, 4, K) == 0
    assert lay.offset(0, 5, V) == 3 * lay.bytes_per_kv_layer
    with pytest.raises(IndexError, match="layer 3 not held"):
        lay.offset(0, 3, K)
    with pytest.raises(IndexError, match="layer 6 not held"):
        lay.offset(0, 6, K)


@pytest.mark.parametrize("bad", [dict(num_slots=0), dict(dtype="int3"), dict(max_len=-1)])
def test_invalid_geometry_is_rejected_with_the_field_name(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        make(**bad)


def test_out_of_range_tokens_and_slots():
    lay = make()
    with pytest.raises(IndexError):
        lay.token_run(0, 0, K, 17)
    with pytest.raises(IndexError):
        lay.offset(4, 0, K)


def test_round_trip_dict():
    lay = make(first_layer=1)
    assert KVLayout.from_dict(lay.to_dict()) == lay


def test_shard_layers_balanced_and_contiguous():
    assert shard_layers(30, 4) == [range(0, 8), range(8, 16), range(16, 23), range(23, 30)]
    assert shard_layers(5, 1) == [range(0, 5)]
    with pytest.raises(ValueError):
        shard_layers(3, 4)


def test_shape_matches_byte_offsets():
    import math

    lay = make()
    assert math.prod(lay.shape) * lay.dtype_size == lay.total_bytes
    # stride of the slot axis in elements times dtype size is bytes_per_slot
    assert math.prod(lay.shape[1:]) * lay.dtype_size == lay.bytes_per_slot
