"""Continuous batching on the tiny model: joining, leaving, stopping, sampling, adopting.

The slots are the caller's (here the test's): the Generator is told which slot a request uses
and says when the request is done with it."""

from __future__ import annotations

import pytest

from pdserve_worker.kv.cache import KVCache
from pdserve_worker.model.engine import (
    FirstDraw,
    GenerationStats,
    Generator,
    colocated_cache,
    generate,
    greedy_tokens,
    packed_batches,
    prefill_first_token,
)
from pdserve_worker.model.loading.loader import load_model
from pdserve_worker.model.sampling.params import FinishReason, SamplingParams
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


def start(gen: Generator, tiny, slot: int, prompt: list[int], params: SamplingParams, **kwargs):
    """What a caller does: compute the prompt's KV into its slot, hand the request over."""
    first = prefill_first_token(
        tiny.model, gen.cache, slot, prompt, params, FirstDraw(index=kwargs.get("num_generated", 0))
    )
    return gen.add_prefilled(prompt, slot, first, params, **kwargs)


def test_requests_joining_and_leaving_mid_flight_get_their_solo_tokens(tiny, prompts, alone):
    gen = Generator(tiny.model, tiny.tokenizer, colocated_cache(tiny.model, 3, 64))
    free = [0, 1, 2]
    slot_of: dict[str, int] = {}
    tokens: dict[str, list[int]] = {}
    arriving = dict(zip((0, 2, 3, 5, 9), prompts))  # arrivals while others run; more requests than slots
    queued: list[list[int]] = []
    order = []

    def record(out) -> None:
        tokens.setdefault(out.request_id, []).append(out.token_id)
        if out.finished:
            free.append(slot_of.pop(out.request_id))

    for step in range(80):
        if step in arriving:
            queued.append(arriving.pop(step))
        while queued and free:  # the caller admits a waiting request as soon as a slot is free
            slot = free.pop(0)
            request_id, out = start(gen, tiny, slot, queued.pop(0), GREEDY)
            slot_of[request_id] = slot
            order.append(request_id)
            record(out)
        for out in gen.step():
            record(out)
        assert gen.num_running <= 3
        if not gen.has_work() and not queued and not arriving:
            break
    assert [tokens[i] for i in order] == alone
    assert sorted(free) == [0, 1, 2]


def test_a_slot_is_used_by_one_request_at_a_time(tiny, prompts):
    gen = Generator(tiny.model, tiny.tokenizer, colocated_cache(tiny.model, 2, 64))
    running, _ = start(gen, tiny, 1, prompts[0], GREEDY)
    with pytest.raises(ValueError, match=f"slot 1 already holds running request '{running}'"):
        start(gen, tiny, 1, prompts[1], GREEDY)
    with pytest.raises(ValueError, match="slot 2 outside"):
        gen.add_prefilled(prompts[1], 2, 5, GREEDY)
    assert gen.abort(running).finish_reason is FinishReason.ABORT
    start(gen, tiny, 1, prompts[1], GREEDY)  # aborted: the caller may reuse the slot at once
    assert gen.num_running == 1


def test_max_tokens_finishes_with_length_and_text_matches_decode(tiny, prompts):
    [result] = generate(
        tiny.model,
        tiny.tokenizer,
        [prompts[1]],
        SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
        max_len=64,
    )
    assert len(result.output_ids) == 5 and result.finish_reason is FinishReason.LENGTH
    assert result.text == tiny.tokenizer.decode(result.output_ids, skip_special_tokens=True)


def test_a_full_slot_ends_the_request_with_length(tiny, prompts):
    [result] = generate(
        tiny.model,
        tiny.tokenizer,
        [prompts[0]],
        SamplingParams(max_tokens=50, temperature=0, ignore_eos=True),
        max_len=len(prompts[0]) + 3,
    )
    assert result.finish_reason is FinishReason.LENGTH and len(result.output_ids) == 4


def test_stop_token_ends_the_request_without_its_text(tiny, prompts, alone):
    stop = alone[1][4]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=(stop,))
    [result] = generate(tiny.model, tiny.tokenizer, [prompts[1]], params, max_len=64)
    first = alone[1].index(stop)
    assert result.output_ids == alone[1][: first + 1] and result.finish_reason is FinishReason.STOP
    assert result.text == tiny.tokenizer.decode(alone[1][:first], skip_special_tokens=True)


def test_stop_string_cuts_the_text(tiny, prompts):
    [full] = generate(tiny.model, tiny.tokenizer, [prompts[2]], GREEDY, max_len=64)
    stop = full.text[5:8]
    assert stop and len(full.text) > 8
    [cut] = generate(tiny.model, tiny.tokenizer, [prompts[2]], GREEDY.model_copy(update={"stop": (stop,)}), max_len=64)
    assert cut.finish_reason is FinishReason.STOP
    assert cut.text == full.text[: full.text.index(stop)]


def test_include_stop_str_in_output_keeps_the_stop_that_ended_the_text(tiny, prompts, alone):
    """vLLM's include_stop_str_in_output: a stop string stays at the end of the text, and a stop
    token's own text is detokenized too (vllm/v1/engine/detokenizer.py keeps it only then)."""
    [full] = generate(tiny.model, tiny.tokenizer, [prompts[2]], GREEDY, max_len=64)
    stop = full.text[5:8]
    kept = GREEDY.model_copy(update={"stop": (stop,), "include_stop_str_in_output": True})
    [out] = generate(tiny.model, tiny.tokenizer, [prompts[2]], kept, max_len=64)
    assert out.finish_reason is FinishReason.STOP
    assert out.text == full.text[: full.text.index(stop) + len(stop)]

    token = alone[1][4]
    first = alone[1].index(token)
    params = GREEDY.model_copy(update={"stop_token_ids": (token,), "include_stop_str_in_output": True})
    [result] = generate(tiny.model, tiny.tokenizer, [prompts[1]], params, max_len=64)
    assert result.output_ids == alone[1][: first + 1]
    assert result.text == tiny.tokenizer.decode(alone[1][: first + 1], skip_special_tokens=True)


def test_skip_special_tokens_false_shows_special_tokens_as_the_tokenizer_decodes_them(tiny, prompts):
    """A special token forced into the output (logit_bias) is in the text only with
    skip_special_tokens=False, spelled as the tokenizers library decodes it."""
    special = tiny.tokenizer.eos_token_ids[0]
    forced = GREEDY.model_copy(update={"max_tokens": 3, "logit_bias": ((special, 100.0),)})
    [hidden] = generate(tiny.model, tiny.tokenizer, [prompts[0]], forced, max_len=64)
    shown_params = forced.model_copy(update={"skip_special_tokens": False})
    [shown] = generate(tiny.model, tiny.tokenizer, [prompts[0]], shown_params, max_len=64)
    assert shown.output_ids == hidden.output_ids == [special] * 3
    spelled = tiny.tokenizer.decode([special], skip_special_tokens=False)
    assert spelled and hidden.text == "" and shown.text == spelled * 3


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny, prompts):
    params = [SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    together = generate(tiny.model, tiny.tokenizer, prompts[:3], params, max_len=64)
    for i, p in enumerate(params):
        [solo] = generate(tiny.model, tiny.tokenizer, [prompts[i]], p, max_len=64)
        assert solo.output_ids == together[i].output_ids
    [other_seed] = generate(tiny.model, tiny.tokenizer, [prompts[0]], params[1], max_len=64)
    assert together[0].output_ids != other_seed.output_ids


def test_adopting_a_request_prefilled_elsewhere_continues_identically(tiny, prompts):
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=11, ignore_eos=True)
    [reference] = generate(tiny.model, tiny.tokenizer, [prompts[3]], params, max_len=64)
    gen = Generator(tiny.model, tiny.tokenizer, colocated_cache(tiny.model, 2, 64))
    # "Prefill worker": fills slot 1 and draws the first token with the request's seed.
    _, out = start(gen, tiny, 1, prompts[3], params)
    tokens = [out.token_id] + [o.token_id for o in gen.stream()]
    assert tokens == reference.output_ids
    assert not gen.has_work()


def test_abort_takes_the_request_out_and_says_so_once(tiny, prompts):
    gen = Generator(tiny.model, tiny.tokenizer, colocated_cache(tiny.model, 1, 64))
    rid, _ = start(gen, tiny, 0, prompts[0], GREEDY)
    gen.step()
    out = gen.abort(rid)
    assert out is not None and out.finished and out.finish_reason is FinishReason.ABORT
    assert gen.abort(rid) is None
    assert not gen.has_work()


def test_prompt_that_does_not_fit_is_rejected(tiny):
    gen = Generator(tiny.model, tiny.tokenizer, colocated_cache(tiny.model, 1, 8))
    with pytest.raises(ValueError, match="no room"):
        gen.add_prefilled(list(range(8)), 0, 1, GREEDY)
    with pytest.raises(ValueError, match="no tokens"):
        gen.check_prompt([])
    assert not gen.has_work()


def test_eos_stops_generation(tiny, prompts):
    [free] = generate(tiny.model, tiny.tokenizer, [prompts[4]], GREEDY, max_len=64)
    # A tokenizer whose EOS is a token the model is known to produce third.
    eos = free.output_ids[2]
    tokenizer = Tokenizer(tiny.tokenizer.backend, chat_template=None, eos_token_ids=(eos,))
    [stopped] = generate(tiny.model, tokenizer, [prompts[4]], SamplingParams(max_tokens=12, temperature=0), max_len=64)
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.output_ids == free.output_ids[: free.output_ids.index(eos) + 1]


def _stream_one(tiny, prompt: list[int], params: SamplingParams) -> list[tuple[int | None, str, str | None]]:
    gen = Generator(tiny.model, tiny.tokenizer, colocated_cache(tiny.model, 1, 64))
    _, out = start(gen, tiny, 0, prompt, params)
    return [(o.token_id, o.text, o.finish_reason) for o in [out, *gen.stream()]]


@pytest.mark.parametrize("stop", [(), ("the",)])
def test_a_resumed_request_streams_exactly_what_the_broken_one_would_have(tiny, prompts, stop):
    """Another worker emitted the first k tokens and died: the rest, text deltas included, is unchanged."""
    params = SamplingParams(max_tokens=10, temperature=0.9, seed=5, ignore_eos=True, stop=list(stop))
    reference = _stream_one(tiny, prompts[2], params)
    emitted = [t for t, _, _ in reference if t is not None]
    for k in range(1, len(emitted)):
        gen = Generator(tiny.model, tiny.tokenizer, colocated_cache(tiny.model, 1, 64))
        _, out = start(gen, tiny, 0, prompts[2] + emitted[:k], params, num_generated=k)  # the prefill samples index k
        resumed = [(out.token_id, out.text, out.finish_reason)] + [
            (o.token_id, o.text, o.finish_reason) for o in gen.stream()
        ]
        assert resumed == reference[k:], f"resumed after {k} tokens"


def test_resuming_rejects_counts_that_leave_nothing_to_do(tiny, prompts):
    gen = Generator(tiny.model, tiny.tokenizer, colocated_cache(tiny.model, 1, 64))
    with pytest.raises(ValueError, match="max_tokens"):
        gen.add_prefilled(prompts[0] + [1, 2], 0, 3, SamplingParams(max_tokens=2), num_generated=2)
    with pytest.raises(ValueError, match="must leave a prompt"):
        gen.add_prefilled([1, 2], 0, 3, GREEDY, num_generated=2)
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

    stats = GenerationStats()
    assert [
        r.output_ids for r in generate(Counting(), tiny.tokenizer, prompts, GREEDY, max_len=64, stats=stats)
    ] == alone
    assert passes == [5] and stats.prefill_tokens == sum(len(p) for p in prompts)
    # A budget of two prompts' tokens: each pass takes as many as fit, the first always.
    passes.clear()
    budget = len(prompts[0]) + len(prompts[1])
    got = generate(Counting(), tiny.tokenizer, prompts, GREEDY, max_len=64, prefill_token_budget=budget)
    assert [r.output_ids for r in got] == alone
    assert sum(passes) == 5 and passes[0] == 2 and len(passes) > 1
    with pytest.raises(ValueError, match="prefill_token_budget must be positive"):
        generate(tiny.model, tiny.tokenizer, prompts[:1], GREEDY, max_len=64, prefill_token_budget=0)


def test_packed_batches_fill_each_pass_up_to_the_budget_and_never_leave_a_prompt_out():
    assert packed_batches([3, 4, 2, 9, 1], 7) == [range(0, 2), range(2, 3), range(3, 4), range(4, 5)]
    assert packed_batches([10], 4) == [range(0, 1)]  # a prompt longer than the budget still goes alone
    assert packed_batches([], 4) == []
    assert packed_batches([1, 1, 1], 100) == [range(0, 3)]


def test_a_request_whose_draw_fails_is_aborted_alone(tiny, prompts, alone, monkeypatch):
    """A sampler that raises (parameters it cannot honour) ends its own request with 'abort'
    and hands its slot back; before, the exception left `step()` and the decode's generation
    loop failed every request of the batch with it."""
    gen = Generator(tiny.model, tiny.tokenizer, colocated_cache(tiny.model, 3, 64))
    tokens: dict[str, list[int]] = {}
    sampled = SamplingParams(max_tokens=12, temperature=0.8, seed=5, ignore_eos=True)  # (a plain greedy row
    for slot, prompt in enumerate(prompts[:3]):  # is the batch's argmax: it has no draw to fail)
        request_id, first = start(gen, tiny, slot, prompt, GREEDY if slot < 2 else sampled)
        tokens[request_id] = [first.token_id]
    *good, bad = tokens

    def refuse(logits, index, *context):
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")

    monkeypatch.setattr(gen._running[bad].sampler, "draw", refuse)
    aborted = []
    while gen.has_work():
        for out in gen.step():
            if out.request_id == bad:
                aborted.append(out)
            else:
                tokens[out.request_id].append(out.token_id)
    assert [(o.finished, o.finish_reason, o.token_id) for o in aborted] == [(True, FinishReason.ABORT, None)]
    assert [tokens[i] for i in good] == alone[:2]
    assert gen.num_running == 0 and gen._slots == {}


def test_warm_up_runs_a_prefill_and_decode_steps_and_leaves_no_trace(tiny_model_dir):
    from pdserve_worker.model.engine import warm_up
    from pdserve_worker.model.loading.loader import load_model

    whole = load_model(str(tiny_model_dir), dtype="float32").model
    assert warm_up(whole) > 0.0
    calls: list[str] = []
    original = whole.decode_step

    def counted(*args, **kwargs):
        calls.append("decode")
        return original(*args, **kwargs)

    whole.decode_step = counted  # type: ignore[method-assign]
    warm_up(whole)
    assert calls == ["decode", "decode"]  # batch 1, then batch 2
    half = load_model(str(tiny_model_dir), dtype="float32", layers=range(0, 1)).model
    assert warm_up(half) == 0.0  # a layer-sharded member's steps need its group


def test_the_batchs_argmax_is_each_plain_greedy_rows_draw():
    """A step takes plain greedy rows' tokens from one argmax of the batch: the same token as the
    row's own `Sampler.draw` (ties included: both take the first maximum), and none where a
    row needs more than the argmax (processors, logprobs, a grammar)."""
    from types import SimpleNamespace

    import torch

    from pdserve_worker.model.engine import _plain_greedy, _plain_greedy_tokens
    from pdserve_worker.model.sampling.sampler import Sampler

    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(2)).bfloat16()
    logits[3, 7] = logits[3, 250] = logits[3].max() + 1  # a tie
    rows = [SimpleNamespace(params=GREEDY)] * 6
    tokens = _plain_greedy_tokens(logits, rows)
    assert tokens == [Sampler(GREEDY).draw(logits[r], 0).token for r in range(6)] and tokens[3] == 7
    assert _plain_greedy(GREEDY)
    for other in (
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0, logprobs=1),
        SamplingParams(temperature=0, repetition_penalty=1.2),
        SamplingParams(temperature=0, min_tokens=3),
    ):
        assert not _plain_greedy(other)
    assert _plain_greedy_tokens(logits, [SimpleNamespace(params=SamplingParams(temperature=0.7))]) is None
