"""Live migration's pieces (decode/migration.py): where each byte goes between two decode pools,
the handoff's one release path, and the engine-level promise — a request detached after k
tokens and continued in another pool from the moved KV gives exactly the tokens and text of an
undisturbed run (greedy, seeded sampling, a stop string)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest
import torch

from pdserve_common.kv_layout import K, KVLayout, V
from pdserve_worker.decode.generation_loop import GenerationLoop, Parked, Prefilled
from pdserve_worker.decode.migration import Handoff, HandoffBook, HandoffUnavailable, PoolPlace, migration_runs
from pdserve_worker.kv.cache import KVCache
from pdserve_worker.kv.paged import PagedKVCache
from pdserve_worker.model.engine import Detached, Generator, colocated_cache, generate, prefill_first_token
from pdserve_worker.model.sampling.params import SamplingParams

MAX_LEN = 64


def slot_layout(slots: int = 3) -> KVLayout:
    return KVLayout(slots, 2, MAX_LEN, kv_heads=2, head_dim=4, dtype="float16")


def paged(block_tokens: int = 4, num_blocks: int = 40) -> KVLayout:
    return dataclasses.replace(slot_layout(), block_tokens=block_tokens, num_blocks=num_blocks)


def token_offset(layout: KVLayout, slot: int, blocks, layer: int, kv: int, t: int) -> int:
    """Independent of the code under test: where token t of (layer, K|V) lives."""
    per = layout.bytes_per_token
    if layout.paged:
        bt = layout.block_tokens
        return layout.blocks.offset(layer, kv, blocks[t // bt]) + (t % bt) * per
    return layout.offset(slot, layer, kv) + t * per


def migration_descriptors(src, src_slot, src_blocks, dst, dst_slot, dst_blocks, *args):
    """`migration_runs` as the contiguous copies they make (what the engine is given)."""
    places = PoolPlace(src, src_slot, src_blocks), PoolPlace(dst, dst_slot, dst_blocks)
    return [d for run in migration_runs(*places, *args) for d in run.descriptors()]


def apply(descs, src: bytearray, dst: bytearray) -> None:
    for d in descs:
        dst[d.dst : d.dst + d.length] = src[d.src : d.src + d.length]


CASES = {
    "paged->paged, fragmented, shared first block": (
        paged(),
        1,
        [7, 3, 4, 5, 20, 21, 22],
        paged(),
        2,
        [9, 10, 30, 2, 1, 11, 12],
        4,
        25,
    ),
    "paged->slot": (paged(), 0, [5, 6, 7, 1, 2, 3, 30], slot_layout(), 2, (), 0, 26),
    "slot->paged": (slot_layout(), 1, (), paged(block_tokens=8), 0, [4, 2, 3], 0, 17),
    "slot->slot": (slot_layout(), 0, (), slot_layout(), 2, (), 0, 31),
}


@pytest.mark.parametrize("case", list(CASES))
def test_descriptors_move_exactly_the_tokens_asked_for(case: str) -> None:
    src_l, src_slot, src_blocks, dst_l, dst_slot, dst_blocks, start, end = CASES[case]
    src = bytearray(i % 251 for i in range(src_l.total_bytes))
    dst = bytearray(b"\xee" * dst_l.total_bytes)
    per = src_l.bytes_per_token
    for layer in range(2):
        for kv in (K, V):
            apply(
                migration_descriptors(src_l, src_slot, src_blocks, dst_l, dst_slot, dst_blocks, layer, kv, start, end),
                src,
                dst,
            )
    written = 0
    for layer in range(2):
        for kv in (K, V):
            for t in range(end):
                s = token_offset(src_l, src_slot, src_blocks, layer, kv, t)
                d = token_offset(dst_l, dst_slot, dst_blocks, layer, kv, t)
                if t < start:
                    assert dst[d : d + per] == b"\xee" * per, f"token {t} below start was written"
                else:
                    assert dst[d : d + per] == src[s : s + per], f"{case}: layer {layer} kv {kv} token {t}"
                    written += per
    assert sum(1 for b in dst if b != 0xEE) <= written  # nothing outside the tokens was touched
    assert written == (end - start) * per * 4


def test_runs_of_consecutive_blocks_on_both_sides_move_as_one_descriptor() -> None:
    layout = paged()
    descs = migration_descriptors(layout, 0, [4, 5, 6], layout, 1, [10, 11, 12], 0, K, 0, 12)
    assert len(descs) == 1 and descs[0].length == 12 * layout.bytes_per_token
    split = migration_descriptors(layout, 0, [4, 5, 6], layout, 1, [10, 11, 20], 0, K, 0, 12)
    assert len(split) == 2


@pytest.mark.parametrize("direction", ["rank->whole", "whole->rank", "rank->other rank"])
def test_head_slices_move_exactly_the_heads_both_pools_hold(direction: str) -> None:
    """A tensor-parallel decode rank holds heads 2..3 of 4: draining, it writes its heads' slice
    of each token's row of a plain decode's pool; a plain decode draining into a TP decode
    writes each rank only its heads; two ranks that share no head exchange nothing."""
    full = dataclasses.replace(paged(), kv_heads=4)
    rank = dataclasses.replace(paged(), kv_heads=2, first_head=2)
    other = dataclasses.replace(paged(), kv_heads=2, first_head=0)
    src_l, dst_l = {"rank->whole": (rank, full), "whole->rank": (full, rank), "rank->other rank": (rank, other)}[
        direction
    ]
    src_blocks, dst_blocks, start, end = [7, 3, 4, 5, 20], [9, 10, 30, 2, 1], 4, 19
    src = bytearray(i % 251 for i in range(src_l.total_bytes))
    dst = bytearray(b"\xee" * dst_l.total_bytes)
    for layer in range(2):
        for kv in (K, V):
            apply(migration_descriptors(src_l, 0, src_blocks, dst_l, 0, dst_blocks, layer, kv, start, end), src, dst)
    head = 4 * 2  # head_dim 4, float16
    shared = range(max(src_l.first_head, dst_l.first_head), min(src_l.head_range.stop, dst_l.head_range.stop))
    for layer in range(2):
        for kv in (K, V):
            for t in range(end):
                s = token_offset(src_l, 0, src_blocks, layer, kv, t)
                d = token_offset(dst_l, 0, dst_blocks, layer, kv, t)
                for h in dst_l.head_range:
                    got = dst[d + (h - dst_l.first_head) * head : d + (h - dst_l.first_head + 1) * head]
                    if t >= start and h in shared:
                        want = src[s + (h - src_l.first_head) * head : s + (h - src_l.first_head + 1) * head]
                        assert got == want, f"{direction}: layer {layer} kv {kv} token {t} head {h}"
                    else:
                        assert got == b"\xee" * head, f"{direction}: token {t} head {h} written"


def test_descriptors_refuse_what_does_not_fit() -> None:
    with pytest.raises(ValueError, match="do not fit the target"):
        migration_descriptors(paged(), 0, [1, 2, 3], paged(), 0, [4, 5], 0, K, 0, 10)
    with pytest.raises(ValueError, match="bytes per token"):
        migration_descriptors(slot_layout(), 0, (), dataclasses.replace(slot_layout(), head_dim=8), 0, (), 0, K, 0, 4)


# ---- the handoff's one release path ---------------------------------------------------------------


def handoff(request_id: str = "r#0", slot: int = 1) -> tuple[Handoff, list[int]]:
    freed: list[int] = []
    return Handoff(Detached(request_id, slot, [1, 2], [3, 4], 7), lambda: freed.append(slot)), freed


def test_a_handoff_is_freed_once_whatever_comes_first() -> None:
    h, freed = handoff()
    h.release()
    h.release()
    assert freed == [1] and h.settled and h.outcome == "released"
    assert not h.take()  # a released handoff cannot be migrated any more


def test_a_release_during_the_push_waits_for_its_end() -> None:
    h, freed = handoff()
    assert h.take() and not h.take()
    h.release()  # the stream was cancelled meanwhile: the push still reads the KV
    assert freed == [] and not h.settled
    h.finish(migrated=True)
    assert freed == [1] and h.outcome == "migrated"
    h.release()
    h.finish(migrated=False)
    assert freed == [1]


def test_the_book_hands_a_handoff_to_one_migrate_of_the_right_request() -> None:
    book = HandoffBook()
    h, freed = handoff("req#3", slot=2)
    book.add(h, generation=99)
    with pytest.raises(HandoffUnavailable):
        book.take("other", 2, 99)
    with pytest.raises(HandoffUnavailable):
        book.take("req", 2, 98)
    assert book.take("req", 2, 99) is h
    with pytest.raises(HandoffUnavailable, match="already migrated"):
        book.take("req", 2, 99)
    h.finish(migrated=False)
    assert book.pending() == 0 and freed == [2]
    h2, freed2 = handoff("x#1", slot=0)
    book.add(h2, 5)
    book.release_all()
    assert freed2 == [0]


# ---- the engine: detach here, continue there --------------------------------------------------------


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    from pdserve_worker.model.loading.loader import load_model

    return load_model(str(tiny_model_dir), dtype="float32")


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(-1).view(torch.uint8)


PARAMS = {
    "greedy": SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True),
    "unseeded": SamplingParams(max_tokens=40, temperature=0.9, ignore_eos=True),
}


@pytest.mark.parametrize("kind", list(PARAMS))
@pytest.mark.parametrize("k", [1, 9])
def test_a_detached_request_continues_in_another_pool_token_for_token(loaded, kind: str, k: int) -> None:
    prompt = loaded.tokenizer.encode("The quick brown fox")
    params = PARAMS[kind]
    src = Generator(loaded.model, loaded.tokenizer, colocated_cache(loaded.model, 2, MAX_LEN))
    first = prefill_first_token(loaded.model, src.cache, 1, prompt, params)
    rid, out = src.add_prefilled(prompt, 1, first, params)
    outs = [out]
    while len(outs) < k:
        outs += src.step()
    detached = src.detach(rid)
    assert detached is not None and not src.has_work() and src.detach(rid) is None
    assert detached.output_ids == [o.token_id for o in outs] and detached.kv_tokens == len(prompt) + k - 1
    # The undisturbed run: the same first token and sampler seed (the one the decode chose, when
    # the request had none), to the end in one pool.
    whole = params.model_copy(update={"seed": detached.seed})
    ref = Generator(loaded.model, loaded.tokenizer, colocated_cache(loaded.model, 1, MAX_LEN))
    prefill_first_token(loaded.model, ref.cache, 0, prompt, whole)
    _, ref_first = ref.add_prefilled(prompt, 0, first, whole)
    ref_rest = list(ref.stream())
    expected = dataclasses.make_dataclass("E", ["output_ids", "text"])(
        [o.token_id for o in [ref_first, *ref_rest]], "".join(o.text for o in [ref_first, *ref_rest])
    )
    if params.seed is not None:  # and a seeded request is what one process gives
        [alone] = generate(loaded.model, loaded.tokenizer, [prompt], params, max_len=MAX_LEN)
        assert alone.output_ids == expected.output_ids

    # Move the KV into scattered blocks of a paged pool, with the descriptors a Migrate uses.
    layout = dataclasses.replace(src.cache.layout, block_tokens=4, num_blocks=40)
    dst_cache = PagedKVCache.allocate(layout)
    blocks = [17, 3, 4, 30, 8, 9, 10, 11, 25, 26, 27, 28, 12, 13, 14, 15]
    dst_cache.bind(0, blocks)
    s_bytes, d_bytes = byte_view(src.cache.tensor), byte_view(dst_cache.tensor)
    for layer in range(layout.num_layers):
        for kv in (K, V):
            for d in migration_descriptors(
                src.cache.layout, 1, (), layout, 0, blocks, layer, kv, 0, detached.kv_tokens
            ):
                d_bytes[d.dst : d.dst + d.length] = s_bytes[d.src : d.src + d.length]
    dst = Generator(loaded.model, loaded.tokenizer, dst_cache)
    tokens = prompt + detached.output_ids
    moved = params.model_copy(update={"seed": detached.seed})  # what the notify carries
    _, replayed = dst.add_prefilled(tokens[:-1], 0, tokens[-1], moved, num_generated=k - 1)
    assert replayed.token_id == detached.output_ids[-1] and not replayed.finished  # (not sent again)
    rest = list(dst.stream())
    assert detached.output_ids + [o.token_id for o in rest] == expected.output_ids
    assert "".join(o.text for o in outs + rest) == expected.text


def test_the_stop_string_state_moves_with_the_request(loaded) -> None:
    prompt = loaded.tokenizer.encode("Paris is the capital of")
    plain = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    [free] = generate(loaded.model, loaded.tokenizer, [prompt], plain, max_len=MAX_LEN)
    stop = free.text[len(free.text) // 2 : len(free.text) // 2 + 3]
    params = plain.model_copy(update={"stop": (stop,)})
    [expected] = generate(loaded.model, loaded.tokenizer, [prompt], params, max_len=MAX_LEN)
    assert expected.finish_reason.value == "stop" and stop not in expected.text
    n = len(expected.output_ids)
    for k in sorted({1, 2, n // 3, n // 2 - 1, n // 2, n // 2 + 1, n - 1} & set(range(1, n))):
        src = Generator(loaded.model, loaded.tokenizer, colocated_cache(loaded.model, 1, MAX_LEN))
        rid, out = src.add_prefilled(prompt, 0, prefill_first_token(loaded.model, src.cache, 0, prompt, params), params)
        outs = [out]
        while len(outs) < k:
            outs += src.step()
        detached = src.detach(rid)
        dst = Generator(loaded.model, loaded.tokenizer, KVCache.allocate(src.cache.layout))
        dst.cache.tensor.copy_(src.cache.tensor)
        tokens = prompt + detached.output_ids
        _, _ = dst.add_prefilled(
            tokens[:-1], 0, tokens[-1], params.model_copy(update={"seed": detached.seed}), num_generated=k - 1
        )
        rest = list(dst.stream())
        assert "".join(o.text for o in outs + rest) == expected.text, f"detached after {k} tokens"
        assert rest[-1].finish_reason == expected.finish_reason


# ---- the loop parks requests -------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_parking_ends_the_stream_and_the_handoff_owns_the_slot(loaded) -> None:
    prompt = loaded.tokenizer.encode("Berlin is")
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    cache = colocated_cache(loaded.model, 2, MAX_LEN)
    loop = GenerationLoop(Generator(loaded.model, loaded.tokenizer, cache))
    loop.start()
    freed = threading.Event()
    try:
        first = prefill_first_token(loaded.model, cache, 0, prompt, params)
        stream = loop.submit("r", prompt, 0, params, freed.set, prefilled=Prefilled(first))
        outs = [await anext(stream), await anext(stream)]
        loop.park_all(Handoff)
        items = [item async for item in stream]
        parked = items[-1]
        assert isinstance(parked, Parked) and all(not isinstance(i, Parked) for i in items[:-1])
        d = parked.handoff.detached
        assert d.output_ids == [o.token_id for o in outs + items[:-1]] and d.slot == 0
        await asyncio.sleep(0.05)
        assert not freed.is_set() and loop.active == 0  # out of the batch, slot still held
        loop.cancel(stream)  # the router went away: the loop releases the handoff
        await asyncio.to_thread(freed.wait, 2)
        assert freed.is_set() and parked.handoff.outcome == "released"
    finally:
        loop.stop()


@pytest.mark.asyncio
async def test_a_stopping_loop_releases_parked_requests(loaded) -> None:
    cache = colocated_cache(loaded.model, 1, MAX_LEN)
    loop = GenerationLoop(Generator(loaded.model, loaded.tokenizer, cache))
    loop.start()
    freed = threading.Event()
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    stream = loop.submit(
        "r",
        [5, 6, 7],
        0,
        params,
        freed.set,
        prefilled=Prefilled(prefill_first_token(loaded.model, cache, 0, [5, 6, 7], params)),
    )
    await anext(stream)
    loop.park_all(Handoff)
    assert isinstance([i async for i in stream][-1], Parked)
    loop.stop()
    assert freed.is_set()
