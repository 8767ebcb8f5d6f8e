"""A decode's prefix cache (kv/decode_prefix.py) and the block table that holds it
(kv/blocks.py): an ended request's whole blocks are found by a later prompt of the same scope
that starts with their tokens, never by another scope's; they never refuse a reservation
(evicted tail first); a reservation that was not given its prompt (a migration's) keeps
nothing; and the tokens the generation loop reports are exactly those whose KV the slot holds."""

from __future__ import annotations

import asyncio

import pytest
import torch

from pdserve_common.kv_layout import KVLayout
from pdserve_worker.kv.block_events import BlockEventLog
from pdserve_worker.kv.blocks import BlockTable, NoFreeBlocks
from pdserve_worker.kv.decode_prefix import CachedPrompt, DecodePrefixCache
from pdserve_worker.kv.prefix_cache import cache_salt

B = 4  # tokens per block
SALT = cache_salt("rev", "float32", B)


def cache(events: BlockEventLog | None = None) -> DecodePrefixCache:
    return DecodePrefixCache(SALT, B, events)


def keep(c: DecodePrefixCache, tokens: list[int], scope: str, blocks: list[int]) -> list[int]:
    return c.keep(c.hashes(tokens, scope), tokens, blocks)


def match(c: DecodePrefixCache, prompt: list[int], scope: str):
    return c.match(c.hashes(prompt, scope)[: (len(prompt) - 1) // B])


def test_a_prompt_finds_the_whole_blocks_it_starts_with_and_leaves_its_last_position() -> None:
    c = cache()
    kept = list(range(10, 21))  # 11 tokens: 2 whole blocks and a partial one
    assert keep(c, kept, "t", [7, 8, 9]) == [9]  # the partial block's reference goes back
    hit = match(c, kept[:8] + [99, 98], "t")
    assert hit.blocks == (7, 8) and hit.token_ids == tuple(kept[:8])
    assert match(c, kept[:8], "t").blocks == (7,)  # 8 tokens: the last position is computed again
    assert match(c, kept[:4] + [0] * 6, "t").blocks == (7,)  # differs in block 2
    assert match(c, [1] + kept[1:], "t").blocks == ()  # differs in block 1: nothing follows
    assert match(c, kept, "other tenant").blocks == ()


def test_a_block_already_cached_under_its_name_is_given_back() -> None:
    c = cache()
    tokens = list(range(8))
    assert keep(c, tokens, "t", [1, 2]) == []
    assert sorted(keep(c, tokens + [5], "t", [3, 4, 5])) == [3, 4, 5]
    assert match(c, tokens + [0], "t").blocks == (1, 2)


def test_eviction_takes_least_recently_used_tails_first_and_records_events() -> None:
    events = BlockEventLog(lambda: [])
    c = cache(events)
    a, b = list(range(8)), list(range(100, 108))
    keep(c, a, "t", [0, 1])
    keep(c, b, "t", [2, 3])
    match(c, a + [0], "t")  # a is used again: b is the least recently used
    assert c.evict(1, lambda block: True) == [3]  # b's tail before its head
    assert c.evict(1, lambda block: block != 2) == [1]  # (2 is read by a reservation: it stays)
    assert match(c, a + [0], "t").blocks == (0,)
    batch = events.since(events.epoch, 0)
    stored = [e.block_hash for e in batch.events if e.stored]
    removed = [e.block_hash for e in batch.events if not e.stored]
    assert len(stored) == 4 and len(removed) == 2 and set(removed) <= set(stored)


def table(blocks: int = 12, slots: int = 4) -> BlockTable:
    layout = KVLayout(slots, 1, blocks * B, 1, 2, "float32", block_tokens=B, num_blocks=blocks)
    t = BlockTable(layout, quarantine_s=0.0)
    t.prefix = cache()
    return t


def reserve(t: BlockTable, request_id: str, prompt: list[int], max_tokens: int = 4, scope: str = "t"):
    """A reservation told its prompt and scope, as a decode's Reserve is by the router."""
    shared = CachedPrompt(tuple(prompt), scope)
    return t.reserve(
        request_id, 10.0, num_tokens=len(prompt) + max_tokens, prompt_tokens=len(prompt), share_from=shared
    )


def serve(t: BlockTable, prompt: list[int], generated: list[int], scope: str = "t", max_tokens: int = 4):
    grant = reserve(t, "r", prompt, max_tokens, scope)
    assert t.note_prompt(grant.slot, grant.generation, prompt) is None
    assert t.commit(grant.slot, grant.generation)
    t.note_kv(grant.slot, grant.generation, prompt + generated)
    t.release(grant.slot, grant.generation)
    return grant


def test_the_next_turn_of_a_conversation_shares_the_blocks_of_the_last() -> None:
    t = table()
    turn1 = list(range(1, 10))  # 9 tokens
    serve(t, turn1, [50, 51, 52])  # KV of 12 tokens: 3 whole blocks kept
    usage = t.usage()
    assert usage.kept_blocks == 3 and usage.tokens_used == 0 and usage.slots.free == 4
    turn2 = turn1 + [50, 51, 52, 60, 61]
    grant = reserve(t, "r2", turn2)
    assert grant.shared == 3
    wrong = turn2[:5] + [0] + turn2[6:]
    assert "differ at position 5" in t.note_prompt(grant.slot, grant.generation, wrong)
    assert t.note_prompt(grant.slot, grant.generation, turn2) is None
    other = reserve(t, "r3", turn2, scope="u")
    assert other.shared == 0  # another tenant's prompt, the same tokens


def test_kept_blocks_never_refuse_a_reservation() -> None:
    t = table(blocks=6, slots=2)
    serve(t, list(range(8)), [9, 9, 9, 9, 9])  # 12 tokens of KV: 3 blocks kept
    assert t.can_admit(6 * B)
    grant = reserve(t, "big", [7] * (5 * B), max_tokens=B)
    assert len(grant.blocks) == 6 and grant.shared == 0 and t.usage().kept_blocks == 0
    with pytest.raises(NoFreeBlocks):
        t.reserve("more", 10.0, num_tokens=B)


def test_what_a_reservation_without_its_prompt_or_an_unfinished_one_holds_is_not_kept() -> None:
    t = table()
    grant = t.reserve("migrated", 10.0, num_tokens=12, prompt_tokens=8)  # a migration's: no prompt, no scope
    assert t.commit(grant.slot, grant.generation)
    t.note_kv(grant.slot, grant.generation, list(range(11)))
    t.release(grant.slot, grant.generation)
    grant = reserve(t, "left", list(range(8)))
    t.release(grant.slot, grant.generation)  # given back before its KV came
    usage = t.usage()
    assert usage.kept_blocks == 0 and usage.free_blocks == 12


@pytest.mark.asyncio
async def test_the_loop_reports_exactly_the_tokens_whose_kv_the_slot_holds(tiny_model_dir) -> None:
    """The KV the slot holds for the reported tokens equals a fresh prefill of those tokens."""
    from pdserve_worker.decode.generation_loop import GenerationLoop, Prefilled
    from pdserve_worker.kv.cache import KVCache
    from pdserve_worker.model.engine import Generator
    from pdserve_worker.model.loading.loader import load_model
    from pdserve_worker.model.sampling.params import SamplingParams
    from pdserve_worker.model.sampling.sampler import Sampler

    loaded = load_model(str(tiny_model_dir), dtype="float32")
    kv = KVCache.allocate(loaded.config.kv_layout(2, 64, "float32"))
    loop = GenerationLoop(Generator(loaded.model, loaded.tokenizer, kv))
    loop.start()
    try:
        prompt = loaded.tokenizer.encode("The quick brown fox")
        params = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
        for cancel in (False, True):
            first = Sampler(params).sample(loaded.model.prefill(prompt, kv, 0), 0)
            reported: list[list[int]] = []
            stream = loop.submit("r", prompt, 0, params, lambda: None, Prefilled(first), keep_kv=reported.append)
            outs = []
            async for out in stream:
                outs.append(out.token_id)
                if cancel and len(outs) == 4:
                    loop.cancel(stream)
            await asyncio.sleep(0.05)
            [tokens] = reported
            drawn = [t for t in outs if t is not None]
            assert tokens[: len(prompt)] == prompt and tokens[len(prompt) :] == drawn[: len(tokens) - len(prompt)]
            assert len(tokens) - len(prompt) >= (3 if cancel else 8)
            loaded.model.prefill(tokens, kv, 1)  # the same tokens, computed at once
            n = len(tokens)
            for layer in range(kv.layout.num_layers):
                torch.testing.assert_close(kv.keys(layer)[0, :n], kv.keys(layer)[1, :n], rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(kv.values(layer)[0, :n], kv.values(layer)[1, :n], rtol=1e-4, atol=1e-4)
    finally:
        loop.stop()


def test_a_reservation_that_cannot_fit_lets_go_of_nothing_kept() -> None:
    """Kept blocks go only for a reservation they make room for: one refused anyway (too big for
    what eviction could free, or no handle left) leaves the cache as it was."""
    t = table(blocks=6, slots=2)
    serve(t, list(range(13)), [])  # 3 whole prompt blocks kept
    held = t.reserve("held", 10.0, num_tokens=2 * B)  # 2 of the 3 free blocks
    with pytest.raises(NoFreeBlocks):
        t.reserve("too big", 10.0, num_tokens=5 * B)  # 1 free + 3 kept < 5
    assert t.usage().kept_blocks == 3
    t.reserve("last handle", 10.0, num_tokens=B)
    with pytest.raises(NoFreeBlocks):
        t.reserve("no handle", 10.0, num_tokens=B)
    assert t.usage().kept_blocks == 3
    t.release(held.slot, held.generation)


def test_a_request_that_ends_on_its_first_token_keeps_its_prompt() -> None:
    """The generation loop reports the prompt of a request whose first output is its last (max
    tokens 1, or an immediate stop): its prompt's KV was whole."""
    from pdserve_worker.decode.generation_loop import _END, GenerationLoop, _Entry
    from pdserve_worker.model.engine import FinishReason, StepOutput

    loop = GenerationLoop.__new__(GenerationLoop)  # (only its bookkeeping: no model, no thread)
    reported: list[list[int]] = []
    loop._entries = {"r": _Entry(stream=_Stream(), on_done=lambda: None, keep_kv=reported.append, token_ids=[5, 6, 7])}
    loop._dispatch([StepOutput("r", 9, "x", True, FinishReason.LENGTH)])
    assert reported == [[5, 6, 7]]
    loop._entries = {"c": _Entry(stream=_Stream(), on_done=lambda: None, keep_kv=reported.append, token_ids=[5, 6, 7])}
    loop._end("c", _END)  # cancelled before anything was drawn: the prompt may be part-computed
    assert reported == [[5, 6, 7]]


class _Stream:
    def _put(self, item) -> None:
        pass
