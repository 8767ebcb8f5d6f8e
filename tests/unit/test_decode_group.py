"""Layer-sharded decode groups, engine level: a real prefill pushes each layer chunk into the
members that own it (host engines, one ready notify per member), the group decodes by passing
the hidden state member to member, and the output equals colocated generation token for token."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest
import torch

from netutil import free_port
from pdserve_worker.kv.cache import KVCache
from pdserve_common.kv_layout import KVLayout, shard_layers
from pdserve_worker.kv.pool import KVPool
from pdserve_worker.model.generate import Generator, colocated_cache, prefill_first_token
from pdserve_worker.model.loader import load_model
from pdserve_worker.model.sampling import Sampler
from pdserve_worker.model.sampling_params import SamplingParams
from pdserve_worker.model.sharded import GroupKV, ShardedDecoder, ShardMember, member_layouts
from pdserve_worker.decode.group import DecodeGroup, GroupNotReady, MemberEndpoint
from pdserve_worker.decode.generation_loop import GenerationLoop
from pdserve_worker.transfer.engine import create_engine
from pdserve_worker.kv.slots import Grant
from pdserve_worker.transfer.push import KVPusher, PushSource
from pdserve_worker.transfer.readiness import ReadinessTimeout

SLOTS, MAX_LEN = 3, 48
SENTINEL = 7.0  # what every member pool holds before the test: any byte still 7.0 was never written
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(str(tiny_model_dir), dtype="float32")


@pytest.fixture(scope="module")
def prompt(tiny) -> list[int]:
    return tiny.tokenizer.encode("Prefill computes the cache of a prompt; decode reads it.")


class Engines:
    """Host transfer engines started by a test, finalized at its end."""

    def __init__(self) -> None:
        self.pools: list[KVPool] = []
        self.backends = []

    def member(self, layout: KVLayout) -> MemberEndpoint:
        backend = create_engine("cpu")
        engine_id = f"127.0.0.1:{free_port()}"
        backend.check(backend.engine.initialize(engine_id), "initialize")
        pool = KVPool(backend, layout)
        pool.tensor.fill_(SENTINEL)
        self.backends.append(backend)
        self.pools.append(pool)
        return MemberEndpoint(engine_id, backend, pool)

    def prefill_source(self, layout: KVLayout):
        backend = create_engine("cpu")
        backend.check(backend.engine.initialize("127.0.0.1"), "initialize")
        pool = KVPool(backend, layout)
        self.backends.append(backend)
        self.pools.append(pool)
        return backend, pool

    def close(self) -> None:
        for pool in self.pools:
            pool.close()
        for backend in self.backends:
            backend.engine.finalize()


@pytest.fixture
def engines() -> Iterator[Engines]:
    made = Engines()
    yield made
    made.close()


def colocated(tiny, prompt: list[int]) -> tuple[list[int], KVCache]:
    """The baseline: one process, one pool of every layer; its tokens and the KV it wrote (slot 0)."""
    gen = Generator(tiny.model, tiny.tokenizer, colocated_cache(tiny.model, 1, MAX_LEN))
    _, first = gen.add_prefilled(prompt, 0, prefill_first_token(tiny.model, gen.cache, 0, prompt, PARAMS), PARAMS)
    return [first.token_id, *(o.token_id for o in gen.stream())], gen.cache


def build_group(tiny, tiny_model_dir, engines: Engines, shards: int) -> DecodeGroup:
    full = tiny.config.kv_layout(SLOTS, MAX_LEN, "float32")
    layouts = member_layouts(full, shards)
    members = [engines.member(lay) for lay in layouts]
    # Each member loads only its own layers' weights, as a member pod does.
    models = [load_model(str(tiny_model_dir), dtype="float32", layers=lay.layer_range).model for lay in layouts]
    return DecodeGroup(members, models, tiny.tokenizer, quarantine_s=0.0)


def prefill_into(tiny, engines: Engines, targets: list[Grant], prompt: list[int], layers_per_chunk: int = 1):
    """What the prefill role does: compute chunk by chunk, push each chunk as it is done, notify."""
    backend, pool = engines.prefill_source(tiny.config.kv_layout(1, MAX_LEN, "float32"))
    cache = KVCache(pool.layout, pool.tensor)
    pusher = KVPusher(backend, PushSource(pool.base_addr, pool.layout), targets, len(prompt))
    logits = tiny.model.prefill(prompt, cache, 0, layers_per_chunk, on_chunk=pusher.push_chunk)
    first = Sampler(PARAMS).sample(logits, 0)
    stats = pusher.finish({"first_token": first})
    return first, stats


def run_request(tiny, engines: Engines, group: DecodeGroup, prompt: list[int]) -> tuple[list[int], int, object]:
    """Reserve on the group, prefill into every member, wait for all notifies, decode to the end."""
    grants = group.reserve("r1", ttl_s=30.0)
    assert {(g.slot, g.generation) for g in grants} == {(grants[0].slot, grants[0].generation)}
    first, stats = prefill_into(tiny, engines, grants, prompt)
    slot, generation = grants[0].slot, grants[0].generation
    ready = group.wait_ready(slot, generation, timeout_s=10.0)
    assert (ready.num_tokens, ready.first_token) == (len(prompt), first)
    assert group.slots.commit(slot, generation)
    loop = GenerationLoop(group.generator, name="group-test-loop")
    freed: list[int] = []

    async def decode() -> list[int]:
        loop.start()
        try:
            stream = loop.submit("r1", prompt, slot, PARAMS, lambda: freed.append(group.release(slot, generation)),
                                 first_token=first)
            return [out.token_id async for out in stream if out.token_id is not None]
        finally:
            loop.stop()

    tokens = asyncio.run(decode())
    assert freed == [True], "the group's slot is released exactly once, when the request left the batch"
    return tokens, slot, stats


@pytest.mark.parametrize("shards", [1, 2, 3])
def test_group_output_equals_colocated_and_each_pool_holds_exactly_its_layers(
    tiny, tiny_model_dir, prompt, engines: Engines, shards: int
) -> None:
    expected, reference = colocated(tiny, prompt)
    group = build_group(tiny, tiny_model_dir, engines, shards)
    assert [m.pool.layout.layer_range for m in group.members] == shard_layers(tiny.config.num_layers, shards)

    tokens, slot, stats = run_request(tiny, engines, group, prompt)

    assert tokens == expected
    # The prefill pushed each layer once, to its owner only: no member got a foreign layer.
    assert stats.puts == 2 * tiny.config.num_layers
    # KV of prompt + generated tokens (the last sampled token is never fed back).
    written = len(prompt) + len(expected) - 1
    for member in group.members:
        lay = member.pool.layout
        pool = member.pool.tensor
        mine = reference.tensor[0, lay.first_layer : lay.layer_range.stop]
        assert torch.equal(pool[slot, :, :, :written], mine[:, :, :written]), f"member {lay.layer_range}"
        # Nothing else of this pool was touched: later positions, other slots.
        assert bool((pool[slot, :, :, written:] == SENTINEL).all())
        others = [s for s in range(SLOTS) if s != slot]
        assert bool((pool[others] == SENTINEL).all())


def test_group_waits_for_every_member_notify(tiny, tiny_model_dir, prompt, engines: Engines) -> None:
    """A push that reached only some members never starts decoding: the wait names the member."""
    group = build_group(tiny, tiny_model_dir, engines, 2)
    grants = group.reserve("r1", ttl_s=30.0)
    prefill_into(tiny, engines, [grants[0]], prompt)  # member 1 gets nothing
    with pytest.raises(ReadinessTimeout, match="group member 1"):
        group.wait_ready(grants[0].slot, grants[0].generation, timeout_s=0.3)


def test_members_disagreeing_on_the_prompt_fail_the_request(tiny, tiny_model_dir, prompt, engines: Engines) -> None:
    group = build_group(tiny, tiny_model_dir, engines, 2)
    grants = group.reserve("r1", ttl_s=30.0)
    prefill_into(tiny, engines, [grants[0]], prompt)
    prefill_into(tiny, engines, [grants[1]], prompt[:-2])
    with pytest.raises(GroupNotReady, match="num_tokens"):
        group.wait_ready(grants[0].slot, grants[0].generation, timeout_s=5.0)


def test_grants_carry_each_members_pool_and_layers(tiny, tiny_model_dir, engines: Engines) -> None:
    group = build_group(tiny, tiny_model_dir, engines, 3)
    grants = group.reserve("r9", ttl_s=30.0)
    assert [g.engine_id for g in grants] == [m.engine_id for m in group.members]
    assert [g.base_addr for g in grants] == [m.pool.base_addr for m in group.members]
    assert [json.dumps(g.layout.to_dict()) for g in grants] == [
        json.dumps(m.pool.layout.to_dict()) for m in group.members
    ]
    assert group.slots.usage().reserved == 1


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
        ShardMember(only_low, KVCache.allocate(high))


def test_batched_sharded_step_equals_unsharded_step(tiny) -> None:
    """Several slots of different lengths in one step: hop by hop equals the whole model."""
    full = tiny.config.kv_layout(SLOTS, MAX_LEN, "float32")
    whole = KVCache.allocate(full)
    members = [ShardMember(tiny.model, KVCache.allocate(lay)) for lay in member_layouts(full, 3)]
    decoder = ShardedDecoder.local(members)
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    for slot, p in enumerate(prompts):
        tiny.model.prefill(p, whole, slot)
    for m in members:  # each member's pool gets its layers of the whole model's KV, as a push does
        m.cache.tensor.copy_(whole.tensor[:, m.layers.start : m.layers.stop])
    slots, positions, tokens = [0, 1, 2], [len(p) for p in prompts], [20, 21, 22]
    expected = tiny.model.decode_step(whole, slots, positions, tokens)
    got = decoder.decode_step(None, slots, positions, tokens)
    assert torch.equal(got, expected)
