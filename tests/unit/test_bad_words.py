"""vLLM's bad_words (#31 item 3), ported rule by rule and checked with a real tokenizer.

- Which token sequences a word becomes: vllm/sampling_params.py,
  `SamplingParams.update_from_tokenizer` (the word as written with leading spaces stripped, and
  with one leading space when that is a different first token of the same length; a word that
  tokenizes to nothing refused).
- What the sampler bans: vllm/v1/sample/ops/bad_words.py, `_apply_bad_words_single_batch` (a
  sequence's last token, where the output — not the prompt — ends with the rest; a sequence
  longer than the output + 1 is skipped).
"""

from __future__ import annotations

import pytest
import torch

from pdserve_worker.api.bad_words import MAX_BAD_WORD_SEQUENCES, BadWordsError, bad_word_ids
from pdserve_worker.kv.cache import KVCache
from pdserve_worker.model.engine import generate, greedy_tokens
from pdserve_worker.model.loading.loader import load_model
from pdserve_worker.model.sampling import processors
from pdserve_worker.model.sampling.params import SamplingParams


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(str(tiny_model_dir), dtype="float32")


def encoder(tiny):
    return lambda text: tiny.tokenizer.encode(text, add_special_tokens=False)


def test_a_word_becomes_its_plain_and_spaced_token_sequences(tiny):
    encode = encoder(tiny)
    for word in ("hello", "  world", "Paris is"):
        plain, spaced = tuple(encode(word.lstrip())), tuple(encode(" " + word.lstrip()))
        expected = [plain] + ([spaced] if spaced[0] != plain[0] and len(spaced) == len(plain) else [])
        assert list(bad_word_ids([word], encode)) == expected
    assert bad_word_ids(["hello", "hello"], encode) == bad_word_ids(["hello"], encode)  # duplicates once


def test_words_that_cannot_be_enforced_are_refused_with_their_name(tiny):
    encode = encoder(tiny)
    with pytest.raises(BadWordsError, match="' '.*no token"):
        bad_word_ids([" "], encode)
    with pytest.raises(BadWordsError, match="at most 64"):
        bad_word_ids(["x" * 2000], lambda text: list(range(len(text))))
    with pytest.raises(BadWordsError, match=f"at most {MAX_BAD_WORD_SEQUENCES}"):
        bad_word_ids([f"w{i}" for i in range(MAX_BAD_WORD_SEQUENCES + 1)], lambda text: [int(text.strip()[1:])])


def test_the_sampler_bans_a_last_token_only_after_the_rest():
    words = ((5,), (1, 2), (1, 2, 3), (7, 8, 9, 10))
    assert processors.banned_tokens(words, []) == [5]  # (1, 2) needs one output token first
    assert processors.banned_tokens(words, [4, 1]) == [5, 2]
    assert processors.banned_tokens(words, [1, 2]) == [5, 3]
    assert processors.banned_tokens(words, [9, 1, 2]) == [5, 3]
    logits = torch.zeros(12)
    out = processors.apply(logits, SamplingParams(bad_words=words), [1, 2], [4, 1])
    assert torch.isinf(out[[5, 2]]).all() and torch.isfinite(out[[0, 1, 3, 4, 6]]).all()


def test_greedy_generation_steers_around_a_banned_token_and_a_banned_pair(tiny):
    prompt = tiny.tokenizer.encode("The quick brown fox jumps")
    cache = KVCache.allocate(tiny.config.kv_layout(1, 64, "float32"))
    free = greedy_tokens(tiny.model, cache, 0, prompt, 8)
    base = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    [one] = generate(
        tiny.model, tiny.tokenizer, [prompt], base.model_copy(update={"bad_words": ((free[2],),)}), max_len=64
    )
    assert one.output_ids[:2] == free[:2] and free[2] not in one.output_ids
    pair = (free[1], free[2])
    [two] = generate(tiny.model, tiny.tokenizer, [prompt], base.model_copy(update={"bad_words": (pair,)}), max_len=64)
    assert two.output_ids[:2] == free[:2] and two.output_ids[2] != free[2]
    assert all(tuple(two.output_ids[i : i + 2]) != pair for i in range(len(two.output_ids) - 1))
