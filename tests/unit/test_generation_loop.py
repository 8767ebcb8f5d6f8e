"""The scheduler thread around the engine's Generator: KV from elsewhere (decode) or prompts it
prefills itself (colocated), outputs on the caller's event loop, slots handed back to their
owner exactly once however a request ends."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pdserve_worker.decode.generation_loop import GenerationLoop, RequestFailed
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

        return self.loop.submit("r", prompt, slot, params, done, first_token=first)


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
        bad = d.loop.submit("bad", too_long, 0, SamplingParams(max_tokens=2), lambda: d.freed.append(0), first_token=1)
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
