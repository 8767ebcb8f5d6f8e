from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve_worker.model.sampling.params import SamplingParams
from pdserve_worker.model.sampling.sampler import Sampler, StopStringMatcher, stop_token_ids

LOGITS = torch.log(torch.tensor([0.05, 0.5, 0.3, 0.15]))  # token 1 most likely, then 2, 3, 0


def draws(params: SamplingParams, n: int = 400) -> Counter:
    sampler = Sampler(params)
    return Counter(sampler.sample(LOGITS, i) for i in range(n))


def test_greedy_takes_the_argmax_whatever_the_seed():
    assert set(draws(SamplingParams(temperature=0.0, seed=1), 20)) == {1}
    assert set(draws(SamplingParams(temperature=5.0, top_k=1, seed=2), 20)) == {1}


def test_top_k_and_top_p_cut_the_tail():
    assert set(draws(SamplingParams(top_k=2, seed=3))) == {1, 2}
    # Mass before token 2 is 0.5 < 0.7, before token 3 it is 0.8: keep {1, 2}.
    assert set(draws(SamplingParams(top_p=0.7, seed=4))) == {1, 2}
    assert set(draws(SamplingParams(top_p=0.5, seed=5))) == {1}


def test_draws_follow_the_distribution():
    counts = draws(SamplingParams(temperature=1.0, seed=6), 4000)
    for token, p in enumerate([0.05, 0.5, 0.3, 0.15]):
        assert abs(counts[token] / 4000 - p) < 0.03, counts


def test_temperature_sharpens():
    cold = draws(SamplingParams(temperature=0.3, seed=7), 2000)
    hot = draws(SamplingParams(temperature=1.0, seed=7), 2000)
    assert cold[1] > hot[1]


def test_a_seed_fixes_each_index_independently_of_history():
    a, b = Sampler(SamplingParams(seed=42)), Sampler(SamplingParams(seed=42))
    first = [a.sample(LOGITS, i) for i in range(50)]
    # b draws index 30 first, then the rest: same tokens per index (prefill/decode split safe).
    assert b.sample(LOGITS, 30) == first[30]
    assert [b.sample(LOGITS, i) for i in range(50)] == first
    other = Sampler(SamplingParams(seed=43))
    assert [other.sample(LOGITS, i) for i in range(50)] != first


def test_unseeded_requests_get_their_own_seed():
    assert Sampler(SamplingParams()).seed != Sampler(SamplingParams()).seed


def test_stop_token_ids_include_eos_unless_ignored():
    assert stop_token_ids(SamplingParams(stop_token_ids=(7,)), [2]) == {2, 7}
    assert stop_token_ids(SamplingParams(ignore_eos=True), [2]) == set()


def test_stop_string_is_cut_and_a_possible_start_is_held_back():
    m = StopStringMatcher(("world",))
    assert m.feed("hello wor") == "hello "
    assert m.feed("k and wo") == "work and "
    assert m.feed("rld!") == ""
    assert m.matched == "world"
    assert m.feed("more") == "" and m.finish() == ""


def test_held_text_is_released_at_the_end():
    m = StopStringMatcher(("###",))
    assert m.feed("a ##") == "a "
    assert m.finish() == "##"


def test_two_stops_completed_by_one_token_cut_before_the_one_that_completed_first():
    """The issue's case (stops "abcd" and "bc", "abcd" in one delta): "bc" completes first, so
    the answer is "a", whatever the stops' order and however the text was chunked. (llama.cpp's
    `find_stopping_strings` would keep the earliest start, "", for the single token; vLLM's
    `StopChecker` the first of the list: both depend on the tokenization, this does not.)"""
    for stops in (("abcd", "bc"), ("bc", "abcd")):
        m = StopStringMatcher(stops)
        assert m.feed("abcd") == "a" and m.matched == "bc" and m.finish() == ""
        m = StopStringMatcher(stops)
        assert m.feed("a") + m.feed("bc") + m.feed("d") == "a" and m.matched == "bc"
    # Two ending at the same place: the longer one started earlier and is cut before.
    m = StopStringMatcher(("bc", "abc"))
    assert m.feed("xabcz") == "x" and m.matched == "abc"


def test_stop_split_across_deltas_is_cut_and_never_shown():
    m = StopStringMatcher(("User:",))
    released = [m.feed(p) for p in ["Hello", " Us", "er", ": more"]]
    assert released == ["Hello", " ", "", ""] and m.matched == "User:"  # "Us", "er" held: they may begin "User:"


def test_held_back_prefix_is_released_when_it_turns_out_not_to_be_a_stop():
    m = StopStringMatcher(("abcd",))
    assert [m.feed("ab"), m.feed("c"), m.feed("x"), m.finish()] == ["", "", "abcx", ""]
    assert m.matched is None


def test_without_stops_text_passes_through_at_once():
    m = StopStringMatcher(())
    assert [m.feed("a"), m.feed("b"), m.finish()] == ["a", "b", ""]


def test_an_empty_stop_string_is_refused():
    """It would cut everything: the request is refused where its parameters are read."""
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=("ok", ""))


def earliest_end_cut(text: str, stops: list[str]) -> tuple[str, bool]:
    """The rule on the whole text: cut before the stop string that ends first (the longest of
    those ending there); (the text, False) if none occurs."""
    hits = [(i + len(s), i) for s in stops if (i := text.find(s)) >= 0]
    return (text[: min(hits)[1]], True) if hits else (text, False)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab c\n", max_size=40),
    stops=st.lists(st.text(alphabet="ab c\n", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=8),
)
def test_streamed_output_is_the_cut_of_the_whole_text_however_chunked_and_never_runs_ahead(text, stops, cuts):
    m = StopStringMatcher(tuple(stops))
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    expected, stopped = earliest_end_cut(text, stops)
    shown = ""
    for a, b in zip(bounds, bounds[1:]):
        shown += m.feed(text[a:b])
        # Every prefix of the stream is a prefix of the answer: nothing shown is retracted.
        assert expected.startswith(shown), "text was shown that a later delta revealed to be a stop string"
    assert (shown + m.finish(), m.matched is not None) == (expected, stopped)


def test_invalid_params_are_rejected_with_the_field_name():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=2.0)


@pytest.mark.parametrize("temperature", [1e-300, 1e-45, 5e-39, 1.1e-38, 1e-30, 9.9e-6])
def test_a_vanishing_temperature_is_greedy_as_in_vllm(temperature):
    """vllm/sampling_params.py: `sampling_type` is GREEDY below `_SAMPLING_EPS` (1e-5). Before,
    logits/temperature overflowed float32 (or divided by a temperature that rounds to 0) and
    `torch.multinomial` raised on the NaN softmax."""
    big = LOGITS * 1e3  # large logits overflow first
    assert set(draws(SamplingParams(temperature=temperature, seed=8), 20)) == {1}
    assert {Sampler(SamplingParams(temperature=temperature)).sample(big, i) for i in range(5)} == {1}


def test_sampling_from_1e_minus_5_up_still_draws():
    assert len(set(draws(SamplingParams(temperature=1.0, seed=9), 400))) > 1
    assert set(draws(SamplingParams(temperature=1e-5, seed=9), 50)) == {1}  # sharp, but sampled


@pytest.mark.parametrize("top_p", [1e-300, 1e-46, 1e-10])
def test_a_top_p_that_rounds_to_nothing_keeps_the_most_likely_token(top_p):
    """vLLM's top-p never masks the most likely token; a top_p below float32's range compared
    as 0 and kept none, and the draw raised."""
    assert set(draws(SamplingParams(top_p=top_p, seed=10), 50)) == {1}
