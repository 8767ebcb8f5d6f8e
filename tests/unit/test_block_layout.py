"""Block pool geometry and push descriptors: applying the descriptors byte by byte puts exactly
the source tokens where the block table says, writes nothing else, and coalesces runs."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve_common.kv_layout import (
    BlockLayout,
    Descriptor,
    K,
    KVLayout,
    PushRoute,
    Run,
    V,
    block_runs,
    block_spans,
    push_descriptors,
)


def source_layout(max_len: int = 40, layers: int = 3) -> KVLayout:
    return KVLayout(num_slots=2, num_layers=layers, max_len=max_len, kv_heads=2, head_dim=2, dtype="float32")


def pool(num_blocks: int = 12, bt: int = 4, layers: int = 3, first_layer: int = 0) -> BlockLayout:
    return BlockLayout(num_blocks, bt, layers, kv_heads=2, head_dim=2, dtype="float32", first_layer=first_layer)


def test_offsets_are_layer_major_and_refuse_what_the_pool_does_not_hold() -> None:
    p = pool(first_layer=3)
    assert p.offset(3, K, 0) == 0
    assert p.offset(3, K, 1) == p.bytes_per_block == 4 * 2 * 2 * 4
    assert p.offset(3, V, 0) == 12 * p.bytes_per_block
    assert p.offset(4, K, 0) == 24 * p.bytes_per_block
    assert p.total_bytes == 3 * 2 * 12 * p.bytes_per_block and p.total_tokens == 48
    assert p.shape == (3, 2, 12, 4, 2, 2)
    for bad in ((2, K, 0), (6, K, 0), (3, 2, 0), (3, K, 12), (3, K, -1)):
        with pytest.raises(IndexError):
            p.offset(*bad)
    with pytest.raises(ValueError, match="block_tokens"):
        BlockLayout(4, 0, 1, 1, 1)
    assert BlockLayout(1, 16, 2, 1, 4).for_budget(100).num_blocks == 6
    assert BlockLayout.from_dict(p.to_dict()) == p


def test_runs_of_consecutive_blocks() -> None:
    assert block_runs([]) == []
    assert block_runs([4, 5, 6, 1, 2, 9]) == [Run(0, 4, 3), Run(3, 1, 2), Run(5, 9, 1)]
    assert block_runs([3, 2]) == [Run(0, 3, 1), Run(1, 2, 1)]


def test_contiguous_blocks_cost_one_descriptor_per_layer_and_kv_like_a_slot() -> None:
    src, dst = source_layout(), pool()
    descs = push_descriptors(PushRoute(src, 1, dst, [2, 3, 4]), range(0, 2), end_token=10)
    assert len(descs) == 2 * 2
    first = descs[0]
    assert first == Descriptor(src.token_run(1, 0, K, 10)[0], dst.offset(0, K, 2), 10 * dst.bytes_per_token)
    # fragmented: one per run
    assert len(push_descriptors(PushRoute(src, 0, dst, [7, 2, 3]), range(0, 1), end_token=12)) == 2 * 2


def test_geometry_mismatch_is_refused() -> None:
    other = BlockLayout(4, 4, 3, kv_heads=2, head_dim=4, dtype="float32")
    with pytest.raises(ValueError, match="geometry differs"):
        push_descriptors(PushRoute(source_layout(), 0, other, [0]), range(0, 1), 2)
    one_head = BlockLayout(4, 4, 3, kv_heads=1, head_dim=2, dtype="float32", first_head=1)
    with pytest.raises(IndexError, match="not held by both"):
        push_descriptors(PushRoute(source_layout(), 0, one_head, [0]), range(0, 1), 2, heads=range(0, 2))
    elsewhere = BlockLayout(4, 4, 3, kv_heads=1, head_dim=2, dtype="float32", first_head=5)
    assert push_descriptors(PushRoute(source_layout(), 0, elsewhere, [0]), range(0, 1), 2) == []  # no head in common
    with pytest.raises(IndexError, match="do not fit"):
        push_descriptors(PushRoute(source_layout(), 0, pool(), [0]), range(0, 1), 5)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), bt=st.sampled_from([1, 2, 4, 8]), layers=st.integers(1, 3))
def test_applied_descriptors_move_exactly_the_tokens_into_their_blocks(data, bt, layers) -> None:
    """Byte-level model of a push: the pool afterwards equals the source read through the block
    table for tokens [start, end), and every other byte of the pool is untouched."""
    src = source_layout(max_len=32, layers=layers)
    dst = pool(num_blocks=40 // bt + 2, bt=bt, layers=layers)
    end = data.draw(st.integers(1, 32))
    need = -(-end // bt)
    blocks = data.draw(st.permutations(range(dst.num_blocks)))[:need]
    start = data.draw(st.integers(0, end))
    chunk_start = data.draw(st.integers(0, layers - 1))
    chunk = range(chunk_start, data.draw(st.integers(chunk_start + 1, layers)))
    slot = data.draw(st.integers(0, 1))

    rng = np.random.default_rng(0)
    src_bytes = rng.integers(1, 255, size=src.total_bytes, dtype=np.uint8)
    pool_bytes = np.zeros(dst.total_bytes, dtype=np.uint8)
    descs = push_descriptors(PushRoute(src, slot, dst, blocks), chunk, end_token=end, start_token=start)
    for d in descs:
        assert d.length > 0
        pool_bytes[d.dst : d.dst + d.length] = src_bytes[d.src : d.src + d.length]

    s = src_bytes.view(np.int32).reshape(src.shape)  # ints: random bytes may be NaN as floats
    p = pool_bytes.view(np.int32).reshape(dst.shape)
    expected = np.zeros_like(p)
    for layer in chunk:
        for kv_index in (K, V):
            for t in range(start, end):
                expected[layer, kv_index, blocks[t // bt], t % bt] = s[slot, layer, kv_index, t]
    assert np.array_equal(p, expected)
    # never more descriptors than (layer, K|V, run) triples
    runs = len(block_runs(blocks[start // bt : need])) if end > start else 0
    assert len(descs) <= len(chunk) * 2 * runs


@given(st.lists(st.integers(0, 11), min_size=1, max_size=12, unique=True))
def test_block_spans_cover_exactly_the_blocks_in_every_layer(blocks) -> None:
    dst = pool()
    covered = np.zeros(dst.total_bytes, dtype=bool)
    for off, length in block_spans(dst, blocks):
        assert not covered[off : off + length].any()
        covered[off : off + length] = True
    want = np.zeros(dst.shape[:3], dtype=bool)
    want[:, :, blocks] = True
    got = covered.reshape(dst.num_layers, 2, dst.num_blocks, dst.bytes_per_block).all(axis=3)
    assert np.array_equal(got, want)
    assert covered.reshape(dst.num_layers, 2, dst.num_blocks, -1).any(axis=3).sum() == want.sum()


def test_a_paged_kv_layout_is_its_blocks_and_has_no_slot_runs() -> None:
    paged = KVLayout(
        num_slots=64, num_layers=3, max_len=2048, kv_heads=2, head_dim=2, dtype="float32", block_tokens=4, num_blocks=12
    )
    assert paged.paged and paged.blocks == pool()
    assert paged.shape == pool().shape and paged.total_bytes == pool().total_bytes
    assert paged.kv_tokens == 48
    for call in (
        lambda: paged.offset(0, 0, K),
        lambda: paged.token_run(0, 0, K, 1),
        lambda: paged.slot_span(0),
        lambda: paged.bytes_per_slot,
    ):
        with pytest.raises(ValueError, match="paged KV pool"):
            call()
    slots = KVLayout(num_slots=8, num_layers=3, max_len=2048, kv_heads=2, head_dim=2)
    assert not slots.paged and slots.kv_tokens == 8 * 2048
    with pytest.raises(ValueError, match="no blocks"):
        _ = slots.blocks
    with pytest.raises(ValueError, match="both be positive"):
        KVLayout(num_slots=8, num_layers=3, max_len=64, kv_heads=2, head_dim=2, block_tokens=4)
    assert KVLayout.from_dict(paged.to_dict()) == paged


@settings(max_examples=100, deadline=None)
@given(
    data=st.data(),
    heads=st.sampled_from([1, 2, 4]),
    p_tp=st.sampled_from([1, 2, 4]),
    d_tp=st.sampled_from([1, 2, 4]),
    bt=st.sampled_from([1, 2, 4]),
)
def test_every_rank_pair_of_a_tensor_parallel_push_fills_exactly_the_decode_ranks_heads(
    data, heads, p_tp, d_tp, bt
) -> None:
    """P_tp prefill ranks (each holding its slice of `heads` KV heads, or a replica when tp
    exceeds them) push into D_tp decode ranks' block pools: afterwards each decode pool holds, for
    its own heads, exactly the whole model's KV, and nothing else is written."""
    end = data.draw(st.integers(1, 12))
    need = -(-end // bt)
    num_blocks = 12 // bt + 2
    blocks = data.draw(st.permutations(range(num_blocks)))[:need]
    rng = np.random.default_rng(1)
    whole = rng.integers(1, 1 << 30, size=(2, 2, 16, heads, 2), dtype=np.int32)  # layer, K|V, token, head, dim

    def split(tp: int, rank: int) -> range:
        per = max(1, heads // tp)
        first = rank * per if tp <= heads else rank // (tp // heads)
        return range(first, first + per)

    pools = []
    for d in range(d_tp):
        held = split(d_tp, d)
        dst = BlockLayout(num_blocks, bt, 2, len(held), 2, "float32", first_head=held.start)
        pools.append((held, dst, np.zeros(dst.total_bytes, dtype=np.uint8)))
    pushed = [split(p_tp, p) for p in range(p_tp) if p_tp <= heads or p % (p_tp // heads) == 0]
    for held in pushed:
        src = KVLayout(1, 2, 16, len(held), 2, "float32", first_head=held.start)
        src_bytes = np.ascontiguousarray(whole[None, :, :, :, held.start : held.stop]).view(np.uint8).reshape(-1)
        for _, dst, pool_bytes in pools:
            for desc in push_descriptors(PushRoute(src, 0, dst, blocks), range(0, 2), end_token=end):
                pool_bytes[desc.dst : desc.dst + desc.length] = src_bytes[desc.src : desc.src + desc.length]
    for d_held, dst, pool_bytes in pools:
        got = pool_bytes.view(np.int32).reshape(dst.shape)
        expected = np.zeros_like(got)
        for t in range(end):
            expected[:, :, blocks[t // bt], t % bt] = whole[:, :, t, d_held.start : d_held.stop]
        assert np.array_equal(got, expected)


@settings(max_examples=60, deadline=None)
@given(
    slots=st.integers(1, 3),
    layers=st.integers(1, 3),
    first_layer=st.integers(0, 2),
    heads=st.sampled_from([2, 4]),
    p_tp=st.sampled_from([2, 4]),
    end=st.integers(1, 8),
)
def test_a_tensor_parallel_prefills_head_slices_land_in_a_slot_pool(slots, layers, first_layer, heads, p_tp, end):
    """A layer-sharded decode member keeps slots of max_len tokens ([slot][layer][K|V][token]):
    `KVLayout.slot_blocks` addresses them as blocks (its offsets are `KVLayout.offset`'s), so
    each prefill rank's heads land in their columns of the slot and nothing else is written."""
    max_len = 8
    pool = KVLayout(slots, layers, max_len, heads, 2, "float32", first_layer=first_layer)
    view = pool.slot_blocks
    for slot in range(slots):
        for layer in pool.layer_range:
            for kv in (0, 1):
                assert view.offset(layer, kv, slot) == pool.offset(slot, layer, kv)
    slot = slots - 1
    rng = np.random.default_rng(2)
    whole = rng.integers(1, 1 << 30, size=(layers, 2, max_len, heads, 2), dtype=np.int32)
    got = np.zeros(pool.total_bytes, dtype=np.uint8)
    per = max(1, heads // p_tp)
    for rank in range(min(p_tp, heads)):
        held = range(rank * per, rank * per + per)
        src = KVLayout(1, layers, max_len, per, 2, "float32", first_layer=first_layer, first_head=held.start)
        src_bytes = np.ascontiguousarray(whole[None, :, :, :, held.start : held.stop]).view(np.uint8).reshape(-1)
        for d in push_descriptors(PushRoute(src, 0, view, [slot]), pool.layer_range, end_token=end):
            got[d.dst : d.dst + d.length] = src_bytes[d.src : d.src + d.length]
    shaped = got.view(np.int32).reshape(slots, layers, 2, max_len, heads, 2)
    expected = np.zeros_like(shaped)
    expected[slot, :, :, :end] = whole[:, :, :end]
    assert np.array_equal(shaped, expected)
