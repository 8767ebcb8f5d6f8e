"""The colocated backend (the baseline, `pdserve worker --role colocated`): its SlotTable owns the
slots, requests beyond them wait their turn, and every way out gives the slot back."""

from __future__ import annotations

import asyncio

import pytest

from pdserve_worker.colocated.backend import ColocatedBackend, ColocatedConfig
from pdserve_worker.model.engine import generate
from pdserve_worker.model.loading.loader import load_model
from pdserve_worker.model.sampling.params import FinishReason, SamplingParams

MAX_LEN = 48


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(str(tiny_model_dir), dtype="float32")


async def answer(backend: ColocatedBackend, prompt: list[int], params: SamplingParams, request_id: str):
    return [event async for event in backend.generate(prompt, params, request_id, cache_scope="")]


@pytest.mark.asyncio
async def test_more_requests_than_slots_wait_and_each_equals_generating_alone(loaded):
    backend = ColocatedBackend(loaded, ColocatedConfig(slots=2, max_len=MAX_LEN))
    backend.start()
    try:
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        prompts = [loaded.tokenizer.encode(t) for t in ("Paris is", "The lazy dog", "Numbers like 12", "A model")]
        results = await asyncio.gather(*(answer(backend, p, params, f"r{i}") for i, p in enumerate(prompts)))
        for events, prompt in zip(results, prompts):
            [expected] = generate(loaded.model, loaded.tokenizer, [prompt], params, max_len=MAX_LEN)
            assert [e.token_id for e in events] == expected.output_ids
            assert events[-1].finish_reason is FinishReason.LENGTH and events[0].info is not None
        assert backend.slots.usage().free == 2 and backend.loop.active == 0
    finally:
        backend.close()


@pytest.mark.asyncio
async def test_a_request_closed_early_gives_its_slot_to_the_one_waiting(loaded):
    backend = ColocatedBackend(loaded, ColocatedConfig(slots=1, max_len=512))
    log: list[str] = []
    reserve, release = backend.slots.reserve, backend.slots.release
    backend.slots.reserve = lambda request_id, ttl_s: (log.append(f"grant {request_id}"), reserve(request_id, ttl_s))[1]
    backend.slots.release = lambda slot, generation: (log.append("free"), release(slot, generation))[1]
    backend.start()
    try:
        first = backend.generate(
            [5, 6, 7], SamplingParams(max_tokens=500, temperature=0, ignore_eos=True), "leaver", cache_scope=""
        )
        await anext(first)
        waiting = asyncio.ensure_future(answer(backend, [8, 9], SamplingParams(max_tokens=3, temperature=0), "next"))
        await asyncio.sleep(0)
        await first.aclose()
        events = await asyncio.wait_for(waiting, 30)
        assert len(events) == 3 and events[-1].finish_reason is not None
        # The second request got the only slot after the first gave it back, never alongside it.
        assert log == ["grant leaver", "free", "grant next", "free"]
        assert backend.slots.usage().free == 1 and backend.loop.active == 0
    finally:
        backend.close()
