"""The per-request pipeline between a backend's token events and the router's text deltas."""

from __future__ import annotations

import asyncio

from pdserve_worker.api.backend import Backend, RequestInfo, TokenEvent
from pdserve_worker.api.generation import Delta, Generation
from pdserve_worker.model.sampling.params import SamplingParams


class IteratorBackend(Backend):
    """Returns a plain async iterator (no aclose) whose events never say why they end."""

    model_name = "it"
    max_model_len = 100

    def __init__(self, texts: list[str], info: RequestInfo | None = None) -> None:
        self.texts = texts
        self.info = info

    def tokenize_prompt(self, prompt: str) -> list[int]:
        return [1]

    def tokenize_chat(self, messages: list[dict]) -> list[int]:
        return [1]

    def generate(self, prompt_ids, params, request_id, *, cache_scope):
        events = iter([TokenEvent(i, t, None, self.info if i == 1 else None) for i, t in enumerate(self.texts)])

        class It:
            def __aiter__(self):
                return self

            async def __anext__(self):
                try:
                    return next(events)
                except StopIteration:
                    raise StopAsyncIteration from None

        return It()


def collect(backend, **params) -> tuple[list[Delta], Generation]:
    gen = Generation(backend, [1, 2, 3], SamplingParams(**params), "req-1", arrived=0.0, cache_scope="")

    async def run() -> list[Delta]:
        return [d async for d in gen.deltas()]

    return asyncio.run(run()), gen


def test_a_stream_that_ends_without_finish_reason_is_finished_as_stop():
    deltas, gen = collect(IteratorBackend(["ab", "c", "S"]), stop=("S",), max_tokens=10)
    # The text passes through as the backend sent it: stop strings are the engine's to cut.
    assert [(d.text, d.finish_reason) for d in deltas] == [("ab", None), ("c", None), ("S", None), ("", "stop")]
    assert gen.finish_reason == "stop"
    assert gen.completion_tokens == 3 and gen.prompt_tokens == 3


def test_latest_request_info_and_timing_are_recorded():
    info = RequestInfo(disaggregated=True, kv_bytes=10)
    deltas, gen = collect(IteratorBackend(["a", "b", "c"], info=info), max_tokens=2)
    assert [(d.text, d.finish_reason) for d in deltas] == [("a", None), ("b", "length")]
    assert gen.info == info
    timing = gen.timing(finished=gen.last_token + 1.0)
    assert timing.completion_tokens == 2 and timing.tpot_s == gen.last_token - gen.first_token
    assert timing.e2e_s > 1.0
