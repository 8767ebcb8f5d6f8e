"""A layer-sharded decode's model side (model/layers/layer_shards.py): each member's pool holds a contiguous
share of the layers, a member refuses layers it has no weights for, and hopping the hidden
state member to member equals the whole model's step. The group's serving side (grants on
every member, one ready notification each) is decode/layer_shards.py's: tests/unit/test_decode_shard.py
and tests/integration/test_pd_sharded.py."""

from __future__ import annotations

import pytest
import torch

from pdserve_worker.kv.cache import KVCache
from pdserve_worker.model.layers.layer_shards import GroupKV, LayerShardDecoder, LayerShardMember, member_layouts
from pdserve_worker.model.loading.loader import load_model

SLOTS, MAX_LEN = 3, 48


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(str(tiny_model_dir), dtype="float32")


def test_layouts_that_do_not_tile_the_model_are_rejected(tiny) -> None:
    full = tiny.config.kv_layout(SLOTS, MAX_LEN, "float32")
    assert full.num_layers == 4
    a, b = member_layouts(full, 2)
    with pytest.raises(ValueError, match="starts at layer"):
        GroupKV([b, a], 4)
    with pytest.raises(ValueError, match="model has"):
        GroupKV([a], 4)
    from dataclasses import replace

    with pytest.raises(ValueError, match="num_slots"):
        GroupKV([a, replace(b, num_slots=SLOTS + 1)], 4)


def test_a_member_without_its_layers_weights_is_refused(tiny, tiny_model_dir) -> None:
    full = tiny.config.kv_layout(SLOTS, MAX_LEN, "float32")
    low, high = member_layouts(full, 2)
    only_low = load_model(str(tiny_model_dir), dtype="float32", layers=low.layer_range).model
    with pytest.raises(ValueError, match="lacks weights"):
        LayerShardMember(only_low, KVCache.allocate(high))


def test_batched_sharded_step_equals_unsharded_step(tiny) -> None:
    """Several slots of different lengths in one step: hop by hop equals the whole model."""
    full = tiny.config.kv_layout(SLOTS, MAX_LEN, "float32")
    whole = KVCache.allocate(full)
    members = [LayerShardMember(tiny.model, KVCache.allocate(lay)) for lay in member_layouts(full, 3)]
    decoder = LayerShardDecoder.local(members)
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    for slot, p in enumerate(prompts):
        tiny.model.prefill(p, whole, slot)
    for m in members:  # each member's pool gets its layers of the whole model's KV, as a push does
        m.cache.tensor.copy_(whole.tensor[:, m.layers.start : m.layers.stop])
    slots, positions, tokens = [0, 1, 2], [len(p) for p in prompts], [20, 21, 22]
    expected = tiny.model.decode_step(whole, slots, positions, tokens)
    got = decoder.decode_step(None, slots, positions, tokens)
    assert torch.equal(got, expected)
