"""The scheduler thread around the engine's Generator: KV from elsewhere (decode) or prompts it
prefills itself (colocated), outputs on the caller's event loop, slots handed back to their
owner exactly once however a request ends."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pdserve_worker.decode.generation_loop import GenerationLoop, Prefilled, RequestFailed
from pdserve_worker.kv.cache import KVCache
from pdserve_worker.model.engine import Generator, colocated_cache, generate, prefill_first_token
from pdserve_worker.model.sampling.params import SamplingParams
from pdserve_worker.model.sampling.sampler import Sampler

MAX_LEN, SLOTS = 64, 2


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    from pdserve_worker.model.loading.loader import load_model

    return load_model(str(tiny_model_dir), dtype="float32")


def colocated(loaded, prompt, params):
    [done] = generate(loaded.model, loaded.tokenizer, [prompt], params, max_len=MAX_LEN)
    return done


class Decode:
    """A loop over external slots, plus what a prefill would have pushed into them."""

    def __init__(self, loaded) -> None:
        self.loaded = loaded
        layout = loaded.config.kv_layout(SLOTS, MAX_LEN, "float32")
        self.cache = KVCache.allocate(layout)
        self.loop = GenerationLoop(Generator(loaded.model, loaded.tokenizer, self.cache))
        self.freed: list[int] = []
        self.freed_once = threading.Event()

    def push(self, slot: int, prompt: list[int], params: SamplingParams) -> int:
        """Prefill into `slot` as a prefill worker would; the first token, as its notify carries."""
        logits = self.loaded.model.prefill(prompt, self.cache, slot)
        return Sampler(params).sample(logits, 0)

    def submit(self, slot: int, prompt: list[int], params: SamplingParams):
        first = self.push(slot, prompt, params)

        def done() -> None:
            self.freed.append(slot)
            self.freed_once.set()

        return self.loop.submit("r", prompt, slot, params, done, prefilled=Prefilled(first))


async def drain(stream) -> list:
    return [out async for out in stream]


@pytest.mark.asyncio
async def test_pushed_kv_decodes_like_colocated_and_each_slot_comes_back_once(loaded):
    d = Decode(loaded)
    d.loop.start()
    try:
        prompts = [loaded.tokenizer.encode(t) for t in ("The quick brown fox", "Paris is", "A language model")]
        params = SamplingParams(max_tokens=10, temperature=0.9, seed=5)
        for round_ in range(2):  # more requests than slots, so every slot is reused
            streams = [d.submit(slot, p, params) for slot, p in zip(range(SLOTS), prompts[round_:])]
            results = await asyncio.gather(*(drain(s) for s in streams))
            for outs, prompt in zip(results, prompts[round_:]):
                expected = colocated(loaded, prompt, params)
                assert [o.token_id for o in outs] == expected.output_ids
                assert "".join(o.text for o in outs) == expected.text
                assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert sorted(d.freed) == [0, 0, 1, 1]
    finally:
        d.loop.stop()


@pytest.mark.asyncio
async def test_cancel_takes_a_request_out_of_the_batch_and_frees_its_slot(loaded):
    d = Decode(loaded)
    d.loop.start()
    try:
        params = SamplingParams(max_tokens=MAX_LEN - 8, temperature=0, ignore_eos=True)
        stream = d.submit(1, [3, 4, 5], params)
        await anext(stream)
        d.loop.cancel(stream)
        rest = await drain(stream)
        assert len(rest) < MAX_LEN - 9 and not any(o.finished for o in rest)
        assert await asyncio.to_thread(d.freed_once.wait, 5) and d.freed == [1]
        assert d.loop.active == 0
    finally:
        d.loop.stop()


@pytest.mark.asyncio
async def test_a_request_the_engine_refuses_fails_alone(loaded):
    d = Decode(loaded)
    d.loop.start()
    try:
        too_long = list(range(1, MAX_LEN + 1))
        bad = d.loop.submit(
            "bad", too_long, 0, SamplingParams(max_tokens=2), lambda: d.freed.append(0), prefilled=Prefilled(1)
        )
        with pytest.raises(RequestFailed, match="max_len|leaves no room"):
            await drain(bad)
        assert d.freed == [0]
        good = await drain(d.submit(1, [7, 8, 9], SamplingParams(max_tokens=3, temperature=0)))
        assert good[-1].finished
    finally:
        d.loop.stop()


@pytest.mark.asyncio
async def test_a_loop_with_prefill_computes_the_prompt_itself_in_the_callers_slot(loaded):
    cache = colocated_cache(loaded.model, SLOTS, MAX_LEN)
    prefilled: list[int] = []

    def prefill(prompt: list[int], slot: int, params: SamplingParams) -> int:
        prefilled.append(slot)
        return prefill_first_token(loaded.model, cache, slot, prompt, params)

    loop = GenerationLoop(Generator(loaded.model, loaded.tokenizer, cache), prefill=prefill)
    loop.start()
    freed: list[int] = []
    try:
        params = SamplingParams(max_tokens=6, temperature=0)
        prompts = [loaded.tokenizer.encode(t) for t in ("Berlin is", "The lazy dog")]
        streams = [
            loop.submit(f"c{i}", p, 1 - i, params, lambda i=i: freed.append(1 - i)) for i, p in enumerate(prompts)
        ]
        results = await asyncio.gather(*(drain(s) for s in streams))
        for outs, prompt in zip(results, prompts):
            assert [o.token_id for o in outs] == colocated(loaded, prompt, params).output_ids
        assert sorted(prefilled) == [0, 1] and sorted(freed) == [0, 1]
        too_long = await drain(loop.submit("long", list(range(1, MAX_LEN + 1)), 0, params, lambda: freed.append(0)))
    except RequestFailed as exc:
        assert "leaves no room" in str(exc) and freed.count(0) == 2  # refused before any prefill, slot handed back
        assert sorted(prefilled) == [0, 1]
    else:
        raise AssertionError(f"a prompt longer than the slot was served: {too_long}")
    finally:
        loop.stop()


@pytest.mark.asyncio
async def test_a_loop_without_prefill_wants_the_first_token(loaded):
    loop = GenerationLoop(Generator(loaded.model, loaded.tokenizer, colocated_cache(loaded.model, 1, MAX_LEN)))
    with pytest.raises(RuntimeError, match="first_token"):
        loop.submit("x", [1, 2], 0, SamplingParams(max_tokens=2), lambda: None)


class Recording:
    """ColocatedPrefill with every call recorded: (slot, positions computed, done)."""

    def __init__(self, loaded, cache, store=None) -> None:
        from pdserve_worker.colocated.prefill import ColocatedPrefill

        self.inner = ColocatedPrefill(loaded.model, cache, store, loaded.tokenizer)
        self.calls: list[tuple[int, int, bool]] = []
        self.abandoned: list[int] = []

    def advance(self, prompt, slot, params, budget):
        used, drawn = self.inner.advance(prompt, slot, params, budget)
        self.calls.append((slot, used, drawn is not None))
        return used, drawn

    def abandon(self, slot):
        self.abandoned.append(slot)
        self.inner.abandon(slot)


@pytest.mark.asyncio
async def test_a_long_prompt_is_computed_a_chunk_per_step_while_others_decode(loaded):
    long_len, chunk = 200, 16
    cache = colocated_cache(loaded.model, SLOTS, 256)
    prefill = Recording(loaded, cache)
    loop = GenerationLoop(Generator(loaded.model, loaded.tokenizer, cache), prefill=prefill, prefill_chunk_tokens=chunk)
    loop.start()
    try:
        short = loaded.tokenizer.encode("Berlin is")
        params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        running = loop.submit("running", short, 0, params, lambda: None)
        first = await running.__anext__()  # decoding before the long prompt arrives
        long_prompt = [(7 * i) % 90 + 3 for i in range(long_len)]
        arriving = loop.submit("long", long_prompt, 1, SamplingParams(max_tokens=4, temperature=0), lambda: None)
        seen_before = 0
        waiter = asyncio.ensure_future(arriving.__anext__())
        rest = [first]
        async for out in running:
            rest.append(out)
            if not waiter.done():
                seen_before += 1
        long_outs = [await waiter] + await drain(arriving)
    finally:
        loop.stop()
    chunks = [c for c in prefill.calls if c[0] == 1]
    assert [used for _, used, _ in chunks] == [chunk] * (long_len // chunk) + [long_len % chunk]
    assert [done for *_, done in chunks] == [False] * (len(chunks) - 1) + [True]
    # the running request kept getting tokens between the long prompt's chunks
    assert seen_before >= len(chunks) - 2
    # and chunking changed nothing in either answer
    assert [o.token_id for o in rest] == colocated(loaded, short, params).output_ids
    reference = generate(
        loaded.model, loaded.tokenizer, [long_prompt], SamplingParams(max_tokens=4, temperature=0), max_len=256
    )
    assert [o.token_id for o in long_outs] == reference[0].output_ids


@pytest.mark.asyncio
async def test_with_nothing_decoding_a_prompt_is_computed_in_the_idle_budget(loaded):
    """No step to protect: a lone prompt is not cut into prefill_chunk_tokens pieces (each
    piece re-reads the earlier KV and the weights) but computed in chunks of at least
    IDLE_PREFILL_CHUNK_TOKENS; the next prompt, arriving while the first decodes, is chunked."""
    from pdserve_worker.decode.generation_loop import IDLE_PREFILL_CHUNK_TOKENS

    long_len, chunk = 200, 16
    assert long_len <= IDLE_PREFILL_CHUNK_TOKENS
    cache = colocated_cache(loaded.model, SLOTS, 256)
    prefill = Recording(loaded, cache)
    loop = GenerationLoop(Generator(loaded.model, loaded.tokenizer, cache), prefill=prefill, prefill_chunk_tokens=chunk)
    loop.start()
    try:
        prompt = [(7 * i) % 90 + 3 for i in range(long_len)]
        params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
        alone = loop.submit("alone", prompt, 0, params, lambda: None)
        await alone.__anext__()  # whole, and decoding now
        second = loop.submit("second", prompt[::-1], 1, SamplingParams(max_tokens=2, temperature=0), lambda: None)
        await drain(second)
        await drain(alone)
    finally:
        loop.stop()
    assert [(used, done) for slot, used, done in prefill.calls if slot == 0] == [(long_len, True)]
    assert [used for slot, used, _ in prefill.calls if slot == 1] == [chunk] * (long_len // chunk) + [long_len % chunk]


@pytest.mark.asyncio
async def test_a_request_cancelled_between_chunks_lets_go_of_its_slot_and_prefix_pins(loaded):
    from pdserve_worker.kv.prefix_store import PrefixStoreConfig, open_prefix_store

    cache = colocated_cache(loaded.model, SLOTS, 256)
    store = open_prefix_store(cache.layout, PrefixStoreConfig(4096, 1.0, 16, "rev"), loaded.model.device)
    prefill = Recording(loaded, cache, store)
    prefill.inner.scope[0] = prefill.inner.scope[1] = "tenant"
    loop = GenerationLoop(Generator(loaded.model, loaded.tokenizer, cache), prefill=prefill, prefill_chunk_tokens=8)
    freed: list[int] = []
    loop.start()
    try:
        blocker = loop.submit(
            "b", [5, 6, 7], 1, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True), lambda: freed.append(1)
        )
        await blocker.__anext__()
        stream = loop.submit("long", list(range(3, 203)), 0, SamplingParams(max_tokens=4), lambda: freed.append(0))
        while not any(slot == 0 for slot, *_ in prefill.calls):
            await asyncio.sleep(0.01)
        loop.cancel(stream)
        assert await drain(stream) == []
        loop.cancel(blocker)
        await drain(blocker)
    finally:
        loop.stop()
    assert prefill.abandoned == [0] and sorted(freed) == [0, 1]
    assert not any(done for slot, _, done in prefill.calls if slot == 0)
    assert store.stats().pinned_blocks == 0
