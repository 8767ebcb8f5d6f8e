"""Continuous batching on the tiny model: joining, leaving, stopping, sampling, adopting."""

from __future__ import annotations

import pytest

from pdserve_worker.kv.cache import KVCache
from pdserve_worker.model.generate import Generator, greedy_tokens
from pdserve_worker.model.loader import load_model
from pdserve_worker.model.sampling import FINISH_LENGTH, FINISH_STOP, Sampler
from pdserve_worker.model.sampling_params import SamplingParams
from pdserve_worker.model.tokenizer import Tokenizer

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
TEXTS = ("Paris is", "The quick brown fox jumps", "12345", "Unicode text: café 🙂", "A language model")


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(str(tiny_model_dir), dtype="float32")


@pytest.fixture(scope="module")
def prompts(tiny):
    return [tiny.tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def alone(tiny, prompts):
    layout = tiny.config.kv_layout(1, 64, "float32")
    return [greedy_tokens(tiny.model, KVCache.allocate(layout), 0, p, GREEDY.max_tokens) for p in prompts]


def test_requests_joining_and_leaving_mid_flight_get_their_solo_tokens(tiny, prompts, alone):
    gen = Generator(tiny.model, tiny.tokenizer, num_slots=3, max_len=64)
    tokens: dict[str, list[int]] = {}
    ids = [gen.add(prompts[0], GREEDY)]
    for step in range(60):
        if step in (2, 3, 5, 9):  # arrivals while others run; more requests than slots
            ids.append(gen.add(prompts[len(ids)], GREEDY))
        for out in gen.step():
            tokens.setdefault(out.request_id, []).append(out.token_id)
        assert gen.num_running <= 3
        if not gen.has_work() and len(ids) == len(prompts):
            break
    assert [tokens[i] for i in ids] == alone


def test_max_tokens_finishes_with_length_and_text_matches_decode(tiny, prompts):
    gen = Generator(tiny.model, tiny.tokenizer, num_slots=2, max_len=64)
    [result] = gen.generate([prompts[1]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert len(result.output_ids) == 5 and result.finish_reason == FINISH_LENGTH
    assert result.text == tiny.tokenizer.decode(result.output_ids, skip_special_tokens=True)


def test_a_full_slot_ends_the_request_with_length(tiny, prompts):
    gen = Generator(tiny.model, tiny.tokenizer, num_slots=1, max_len=len(prompts[0]) + 3)
    [result] = gen.generate([prompts[0]], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    assert result.finish_reason == FINISH_LENGTH and len(result.output_ids) == 4


def test_stop_token_ends_the_request_without_its_text(tiny, prompts, alone):
    stop = alone[1][4]
    gen = Generator(tiny.model, tiny.tokenizer, num_slots=1, max_len=64)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=(stop,))
    [result] = gen.generate([prompts[1]], params)
    first = alone[1].index(stop)
    assert result.output_ids == alone[1][: first + 1] and result.finish_reason == FINISH_STOP
    assert result.text == tiny.tokenizer.decode(alone[1][:first], skip_special_tokens=True)


def test_stop_string_cuts_the_text(tiny, prompts):
    gen = Generator(tiny.model, tiny.tokenizer, num_slots=1, max_len=64)
    [full] = gen.generate([prompts[2]], GREEDY)
    stop = full.text[5:8]
    assert stop and len(full.text) > 8
    [cut] = gen.generate([prompts[2]], GREEDY.model_copy(update={"stop": (stop,)}))
    assert cut.finish_reason == FINISH_STOP
    assert cut.text == full.text[: full.text.index(stop)]


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny, prompts):
    params = [SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    together = Generator(tiny.model, tiny.tokenizer, num_slots=3, max_len=64).generate(prompts[:3], params)
    for i, p in enumerate(params):
        [solo] = Generator(tiny.model, tiny.tokenizer, num_slots=1, max_len=64).generate([prompts[i]], p)
        assert solo.output_ids == together[i].output_ids
    assert together[0].output_ids != Generator(tiny.model, tiny.tokenizer, num_slots=1, max_len=64).generate(
        [prompts[0]], params[1]
    )[0].output_ids


def test_adopting_a_request_prefilled_elsewhere_continues_identically(tiny, prompts):
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=11, ignore_eos=True)
    [reference] = Generator(tiny.model, tiny.tokenizer, num_slots=1, max_len=64).generate([prompts[3]], params)

    gen = Generator(tiny.model, tiny.tokenizer, num_slots=2, max_len=64)
    slot = gen.reserve_slot()
    # "Prefill worker": fills the slot and draws the first token with the request's seed.
    logits = tiny.model.prefill(prompts[3], gen.cache, slot)
    first = Sampler(params).sample(logits, 0)
    request_id, out = gen.add_prefilled(prompts[3], slot, first, params)
    tokens = [out.token_id] + [o.token_id for o in gen.stream()]
    assert tokens == reference.output_ids
    assert gen.reserve_slot() == slot  # released when the request finished


def test_abort_frees_the_slot(tiny, prompts):
    gen = Generator(tiny.model, tiny.tokenizer, num_slots=1, max_len=64)
    rid = gen.add(prompts[0], GREEDY)
    waiting = gen.add(prompts[1], GREEDY)
    gen.step()
    assert gen.abort(waiting).finish_reason == "abort"
    assert gen.abort(rid).finished
    assert not gen.has_work()
    assert gen.reserve_slot() == 0


def test_prompt_that_does_not_fit_is_rejected(tiny):
    gen = Generator(tiny.model, tiny.tokenizer, num_slots=1, max_len=8)
    with pytest.raises(ValueError, match="no room"):
        gen.add(list(range(8)), GREEDY)
    with pytest.raises(ValueError, match="no tokens"):
        gen.add([], GREEDY)


def test_eos_stops_generation(tiny, prompts):
    [free] = Generator(tiny.model, tiny.tokenizer, num_slots=1, max_len=64).generate([prompts[4]], GREEDY)
    # A tokenizer whose EOS is a token the model is known to produce third.
    eos = free.output_ids[2]
    tokenizer = Tokenizer(tiny.tokenizer.backend, chat_template=None, eos_token_ids=(eos,))
    [stopped] = Generator(tiny.model, tokenizer, num_slots=1, max_len=64).generate(
        [prompts[4]], SamplingParams(max_tokens=12, temperature=0)
    )
    assert stopped.finish_reason == FINISH_STOP
    assert stopped.output_ids == free.output_ids[: free.output_ids.index(eos) + 1]


def _stream_one(gen: Generator, prompt: list[int], params: SamplingParams) -> list[tuple[int | None, str, str | None]]:
    gen.add(prompt, params)
    return [(o.token_id, o.text, o.finish_reason) for o in gen.stream()]


@pytest.mark.parametrize("stop", [(), ("the",)])
def test_a_resumed_request_streams_exactly_what_the_broken_one_would_have(tiny, prompts, stop):
    """Another worker emitted the first k tokens and died: the rest, text deltas included, is unchanged."""
    params = SamplingParams(max_tokens=10, temperature=0.9, seed=5, ignore_eos=True, stop=list(stop))
    reference = _stream_one(Generator(tiny.model, tiny.tokenizer, num_slots=1, max_len=64), prompts[2], params)
    emitted = [t for t, _, _ in reference if t is not None]
    for k in range(1, len(emitted)):
        gen = Generator(tiny.model, tiny.tokenizer, num_slots=1, max_len=64)
        slot = gen.reserve_slot()
        tokens = prompts[2] + emitted[:k]
        logits = tiny.model.prefill(tokens, gen.cache, slot)
        first = Sampler(params).sample(logits, k)  # the prefill worker samples index k
        _, out = gen.add_prefilled(tokens, slot, first, params, num_generated=k)
        resumed = [(out.token_id, out.text, out.finish_reason)] + [
            (o.token_id, o.text, o.finish_reason) for o in gen.stream()
        ]
        assert resumed == reference[k:], f"resumed after {k} tokens"
        assert gen.reserve_slot() == slot


def test_resuming_rejects_counts_that_leave_nothing_to_do(tiny, prompts):
    gen = Generator(tiny.model, tiny.tokenizer, num_slots=1, max_len=64)
    slot = gen.reserve_slot()
    with pytest.raises(ValueError, match="max_tokens"):
        gen.add_prefilled(prompts[0] + [1, 2], slot, 3, SamplingParams(max_tokens=2), num_generated=2)
    with pytest.raises(ValueError, match="must leave a prompt"):
        gen.add_prefilled([1, 2], slot, 3, GREEDY, num_generated=2)
    assert not gen.has_work()


def test_prompts_admitted_together_share_one_prefill_pass_within_the_token_budget(tiny, prompts, alone):
    passes: list[int] = []

    class Counting:
        def __getattr__(self, name):
            return getattr(tiny.model, name)

        def prefill(self, prompt, *args, **kwargs):
            passes.append(1)
            return tiny.model.prefill(prompt, *args, **kwargs)

        def prefill_batch(self, batch, *args, **kwargs):
            passes.append(len(batch))
            return tiny.model.prefill_batch(batch, *args, **kwargs)

    gen = Generator(Counting(), tiny.tokenizer, num_slots=5, max_len=64, cache=KVCache.allocate(
        tiny.config.kv_layout(5, 64, "float32")))
    assert [r.output_ids for r in gen.generate(prompts, GREEDY)] == alone
    assert passes == [5] and gen.stats.prefill_tokens == sum(len(p) for p in prompts)
    # A budget of one prompt's tokens: each pass takes as many as fit, the first always.
    passes.clear()
    budget = len(prompts[0]) + len(prompts[1])
    gen = Generator(Counting(), tiny.tokenizer, num_slots=5, max_len=64, prefill_token_budget=budget,
                    cache=KVCache.allocate(tiny.config.kv_layout(5, 64, "float32")))
    assert [r.output_ids for r in gen.generate(prompts, GREEDY)] == alone
    assert sum(passes) == 5 and passes[0] == 2 and len(passes) > 1
    with pytest.raises(ValueError, match="prefill_token_budget must be positive"):
        Generator(tiny.model, tiny.tokenizer, num_slots=1, max_len=64, prefill_token_budget=0)
