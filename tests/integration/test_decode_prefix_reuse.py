"""Decode-side prefix reuse (#55 item 2), in process: one router, one prefill, two decodes with
prefix caches (kv/decode_prefix.py). Four conversations, each turn of all four at once (the
first turns spread over the decodes), three turns each; each turn's prompt is the last turn's
prompt, its answer and a new question. From turn 2 on, the
router sends the conversation back to the decode that holds it (its block events,
`Decode.BlockEvents`), the decode's grant shares the blocks it kept (its prompt's, and with
`decode_prefix_answers` its answer's), and the prefill pushes only the rest: the request reports the kept tokens as cached and its KV bytes shrink by as much. The
answers are the greedy ones, turn by turn, on the push road and on the decode's own road
(`never`), which computes only what its cache lacks."""

from __future__ import annotations

import asyncio

import pytest

from pdserve_worker.decode.worker import DecodeWorker
from pdserve_worker.engines.native import NativeEngine
from pdserve_worker.model.engine import generate
from pdserve_worker.model.loading.loader import load_model
from pdserve_worker.model.sampling.params import SamplingParams
from pdserve_worker.prefill.worker import PrefillWorker
from pdserve_worker.router.config import Timeouts
from support.inprocess_stack import Stack

SVC, TOKEN, REVISION = "ns/decode-prefix", "decode-prefix-token-0123456789", "rev-decode-prefix"
MAX_LEN, SLOTS, BLOCK = 256, 4, 16
PARAMS = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
SCOPE = '["anonymous",""]'


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(str(tiny_model_dir), dtype="float32")


async def serve(backend, prompt: list[int], request_id: str):
    events = [e async for e in backend.generate(prompt, PARAMS, request_id, cache_scope=SCOPE)]
    infos = [e.info for e in events if e.info is not None]
    return [e.token_id for e in events if e.token_id is not None], infos[-1]


async def conversations(loaded, road: str, answers: bool) -> list[list[tuple[list[int], list[int], object]]]:
    stack = Stack(SVC, TOKEN, max_len=MAX_LEN, slots=SLOTS)
    backend = None
    try:
        decodes = []
        for i in range(2):
            d = stack.settings("decode", i, prefill_chunk_tokens=64, decode_prefix_answers=answers)
            decodes.append(DecodeWorker(d, NativeEngine(loaded), stack.engine(d), REVISION))
            await stack.serve_decode(decodes[-1])
        p = stack.settings("prefill", prefix_cache_tokens=1024)
        await stack.serve_prefill(PrefillWorker(p, NativeEngine(loaded), stack.engine(p), REVISION), REVISION)
        backend = await stack.pd_backend(
            loaded.tokenizer, REVISION, Timeouts(rpc_s=2.0, lease_ms=5000, readiness_ms=10_000, prefill_s=30), 3
        )
        backend.members.disaggregation.policy = road
        tok = loaded.tokenizer
        prompts = [tok.encode(f"Conversation {i}: " + "lorem ipsum dolor sit amet " * (3 + i)) for i in range(4)]
        turns: list[list[tuple[list[int], list[int], object]]] = [[] for _ in prompts]
        # The router must know both decodes (their first block events) before the first turns.
        held = backend.members._decode_held
        async with asyncio.timeout(10):
            while not all(held.knows(f"decode-{d}") for d in range(2)):
                await asyncio.sleep(0.05)

        async def ask(i: int, turn: int) -> None:
            if turn:
                last_prompt, last_answer, _ = turns[i][-1]
                prompts[i] = last_prompt + last_answer + tok.encode(f" Question {turn}?")
            answer, info = await serve(backend, prompts[i], f"c{i}-t{turn}")
            turns[i].append((prompts[i], answer, info))

        for turn in range(3):  # every conversation's turn at once
            await asyncio.gather(*(ask(i, turn) for i in range(len(prompts))))
        for w in decodes:  # what each decode's /metrics says of its cache
            kept = w.metrics.registry.get_sample_value("pdserve_decode_prefix_kept_blocks")
            hits = w.metrics.registry.get_sample_value("pdserve_decode_prefix_hit_blocks_total")
            assert kept == len(w.slots.prefix) > 0 and hits > 0, (kept, hits)
        return turns
    finally:
        if backend is not None:
            await backend.close()
        await stack.close()


def greedy(loaded, prompt: list[int]) -> list[int]:
    [done] = generate(loaded.model, loaded.tokenizer, [prompt], PARAMS, max_len=MAX_LEN)
    return done.output_ids


@pytest.mark.asyncio
@pytest.mark.parametrize(("road", "answers"), [("always", False), ("never", False), ("never", True)])
async def test_a_conversation_returns_to_its_decode_and_only_what_it_lacks_is_pushed(loaded, road, answers):
    turns = await conversations(loaded, road, answers)
    firsts = [conversation[0][2].decode for conversation in turns]
    assert sorted(firsts) == ["decode-0", "decode-0", "decode-1", "decode-1"]  # a burst spreads
    for conversation in turns:
        first_prompt, _, first = conversation[0]
        assert first.cached_tokens == 0
        per_token = first.kv_bytes / len(first_prompt)
        for (last_prompt, last_answer, last), (prompt, answer, info) in zip(conversation, conversation[1:]):
            assert answer == greedy(loaded, prompt)
            assert info.decode == last.decode  # back to the decode that holds the conversation
            # What the last turn's KV held: its prompt, with `answers` its answer but the last token
            # (never fed), in whole blocks, leaving at least the prompt's last position to compute.
            kept = len(last_prompt) + (len(last_answer) - 1 if answers else 0)
            assert (
                info.cached_tokens == min(kept // BLOCK, (len(prompt) - 1) // BLOCK) * BLOCK > len(last_prompt) - BLOCK
            )
            assert info.disaggregated is (road == "always")
            if road == "always":
                assert info.kv_bytes == per_token * (len(prompt) - info.cached_tokens)
            else:
                assert info.kv_bytes == 0
        assert conversation[0][1] == greedy(loaded, first_prompt)
