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


def test_logprobs_are_the_processed_log_softmax_and_ignore_temperature():
    """A draw's logprobs: log-softmax of the logits after the logits processors (here a bias),
    before temperature and truncation; the top alternatives best first; a banned token (-inf)
    is reported as the floor, never as a value JSON cannot carry."""
    from pdserve_worker.model.sampling.params import LOGPROB_FLOOR

    bias = ((0, 3.0),)
    expected = torch.log_softmax(LOGITS + torch.tensor([3.0, 0, 0, 0]), dim=-1)
    seen = set()
    for temperature, top_k in ((0.0, 0), (0.7, 2), (1.9, 0)):
        params = SamplingParams(temperature=temperature, top_k=top_k, seed=1, logit_bias=bias, logprobs=3)
        drawn = Sampler(params).draw(LOGITS.clone(), 0)
        assert drawn.logprobs.logprob == pytest.approx(float(expected[drawn.token]), abs=1e-6)
        assert [i for i, _ in drawn.logprobs.top] == torch.topk(expected, 3).indices.tolist()
        assert [v for _, v in drawn.logprobs.top] == pytest.approx(torch.topk(expected, 3).values.tolist())
        seen.add(drawn.logprobs.top)
    assert len(seen) == 1  # the same values at every temperature
    banned = torch.tensor([0.0, float("-inf"), 1.0, float("-inf")])
    drawn = Sampler(SamplingParams(temperature=0, logprobs=4)).draw(banned, 0)
    assert [v for _, v in drawn.logprobs.top][-2:] == [LOGPROB_FLOOR, LOGPROB_FLOOR]
    assert Sampler(SamplingParams(temperature=0)).draw(LOGITS, 0).logprobs is None


@pytest.mark.parametrize(
    "wire",
    [
        None,
        {"logprob": -1.0},
        {"logprob": -1.0, "top": [[1, -1.0]] * 21},
        {"logprob": float("nan"), "top": []},
        {"logprob": 0.5, "top": []},
        {"logprob": -1.0, "top": [[1.5, -1.0]]},
        {"logprob": -1.0, "top": [[-1, -1.0]]},
        {"logprob": -1.0, "top": [[1, "x"]]},
        {"logprob": -1.0, "top": [[1, -1e9]]},
        {"logprob": True, "top": []},
    ],
)
def test_logprobs_from_another_process_are_refused_unless_they_are_logprobs(wire):
    from pdserve_worker.model.sampling.params import TokenLogprobs

    with pytest.raises(ValueError, match="first_logprobs"):
        TokenLogprobs.from_wire(wire, 20)


def test_logprobs_cross_the_wire_unchanged():
    from pdserve.v1 import common_pb2
    from pdserve_worker.model.sampling.params import TokenLogprobs
    from pdserve_worker.rpc.convert import logprobs_from_proto, logprobs_to_proto

    value = TokenLogprobs(-0.25, ((3, -0.25), (9, -1.5)))
    assert TokenLogprobs.from_wire(value.to_wire(), 20) == value
    assert logprobs_from_proto(logprobs_to_proto(value)) == value
    for bad in (
        common_pb2.TokenLogprobs(logprob=-1, top_ids=[1, 2], top_logprobs=[-1]),
        common_pb2.TokenLogprobs(logprob=0.1),
        common_pb2.TokenLogprobs(logprob=-1, top_ids=[-3], top_logprobs=[-1.0]),
        common_pb2.TokenLogprobs(logprob=-1, top_ids=list(range(21)), top_logprobs=[-1.0] * 21),
    ):
        with pytest.raises(ValueError, match="logprobs"):
            logprobs_from_proto(bad)


def test_logprob_ranks_count_the_tokens_at_least_as_likely():
    """vLLM's rank (vllm/v1/sample/ops/logprobs.py `batched_count_greater_than`): 1 + tokens
    strictly more likely, ties counted against the token; checked against a sort."""
    from pdserve_worker.model.sampling.sampler import rows_logprobs

    logits = torch.tensor([[0.1, 2.0, -1.0, 2.0, 0.5], [3.0, 1.0, 0.0, -2.0, 1.0]])
    got = rows_logprobs(logits, [4, 1], 2)
    for row, token, lp in zip(logits, [4, 1], got, strict=True):
        assert lp.rank == int((row >= row[token]).sum())
    assert [lp.rank for lp in got] == [3, 3]  # 0.5 behind two 2.0s; 1.0 tied with the other 1.0
    assert rows_logprobs(logits, [1, 0], 0)[1].rank == 1
