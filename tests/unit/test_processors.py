"""Logits processors (model/sampling/processors.py, issue #31 item 3) against their upstream meanings:
repetition_penalty is transformers' RepetitionPenaltyLogitsProcessor, presence/frequency are
OpenAI's (vLLM's `apply_penalties`), logit_bias adds, min_tokens masks the stop ids, min_p
drops the unlikely; and through the engine: a biased EOS after min_tokens ends a greedy run at
exactly min_tokens tokens, and a resumed prefill draws as an uninterrupted one would."""

from __future__ import annotations

import pytest
import torch

from pdserve_worker.model.sampling import processors
from pdserve_worker.model.sampling.params import SamplingParams
from pdserve_worker.model.sampling.sampler import Sampler, sample_first

VOCAB = 50


def logits(seed: int = 0) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_repetition_penalty_is_transformers():
    from transformers import RepetitionPenaltyLogitsProcessor

    prompt, output = [3, 4, 4, 9], [9, 11]
    raw = logits(1)
    ours = processors.apply(raw, SamplingParams(repetition_penalty=1.3), prompt, output)
    theirs = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + output]), raw[None].clone())[0]
    assert torch.allclose(ours, theirs)
    assert not torch.equal(ours, raw) and torch.equal(raw, logits(1))  # the input is not changed


def test_presence_and_frequency_are_openais():
    output = [2, 2, 2, 7]
    raw = logits(2)
    got = processors.apply(raw, SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), [1, 2], output)
    want = raw.clone()
    for token in set(output):  # OpenAI: mu[j] - c[j] * alpha_frequency - (c[j] > 0) * alpha_presence
        want[token] -= output.count(token) * 0.25 + 0.5
    assert torch.allclose(got, want)
    assert torch.equal(processors.apply(raw, SamplingParams(presence_penalty=2.0), [1, 2], []), raw)  # no output yet


def test_the_kept_state_gives_what_a_fresh_computation_gives():
    params = SamplingParams(repetition_penalty=1.3, presence_penalty=0.7, frequency_penalty=0.3, logit_bias=((4, 2.0),))
    state = processors.ProcessorState(VOCAB)
    prompt, output = [1, 2, 3, 3], []
    for step in range(12):
        raw = logits(10 + step)
        kept = processors.apply(raw, params, prompt, output, (), state)
        assert torch.allclose(kept, processors.apply(raw, params, prompt, output)), step
        output.append((step * 7) % 9)  # repeats, new tokens and prompt tokens
    assert torch.allclose(
        processors.apply(raw, params, prompt, [5], (), state), processors.apply(raw, params, prompt, [5])
    )


def test_logit_bias_min_tokens_and_min_p():
    raw = logits(3)
    biased = processors.apply(raw, SamplingParams(logit_bias=((5, 100.0), (6, -100.0))), [], [])
    assert int(torch.argmax(biased)) == 5 and biased[6] == raw[6] - 100
    params = SamplingParams(min_tokens=3, max_tokens=10)
    blocked = processors.apply(raw, params, [], [1, 2], stop_ids=[0, 8])
    assert torch.isinf(blocked[0]) and torch.isinf(blocked[8]) and torch.isfinite(blocked[1:8]).all()
    assert torch.equal(processors.apply(raw, params, [], [1, 2, 3], stop_ids=[0, 8]), raw)  # reached: nothing
    # min_p: with a dominant token and min_p 0.5, only it survives.
    peaked = torch.full((VOCAB,), -5.0)
    peaked[7] = 5.0
    draws = {Sampler(SamplingParams(temperature=1.0, min_p=0.5, seed=s)).sample(peaked, 0) for s in range(20)}
    assert draws == {7}
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)


def test_a_resumed_first_token_sees_the_emitted_tokens_as_output():
    raw = logits(4)
    params = SamplingParams(frequency_penalty=2.0, temperature=0)
    tokens = [1, 2, 3, int(torch.argmax(raw))]  # the last one was already streamed (num_generated 1)
    resumed = sample_first(raw, params, tokens, 1, ())
    uninterrupted = Sampler(params).sample(raw, 1, tokens[:3], tokens[3:], ())
    assert resumed == uninterrupted != int(torch.argmax(raw))  # penalised: not the argmax again


@torch.inference_mode()
def test_min_tokens_holds_back_a_biased_eos_exactly_that_long(tiny_model_dir):
    from pdserve_worker.model.engine import generate
    from pdserve_worker.model.loading.loader import load_model

    loaded = load_model(str(tiny_model_dir), dtype="float32")
    eos = sorted(loaded.tokenizer.eos_token_ids)[0]
    ids = loaded.tokenizer.encode("The quick brown fox")
    params = SamplingParams(max_tokens=20, temperature=0, logit_bias=((eos, 100.0),), min_tokens=5)
    [done] = generate(loaded.model, loaded.tokenizer, [ids], params, max_len=64)
    # Five tokens that are not EOS, then EOS (which ends the request and is not streamed).
    assert len(done.output_ids) == 6 and done.output_ids[-1] == eos and eos not in done.output_ids[:5]
    [free] = generate(loaded.model, loaded.tokenizer, [ids], params.model_copy(update={"min_tokens": 0}), max_len=64)
    assert free.output_ids == [eos]
