"""Prefix-aware prefill choice: longest predicted match within the balance bound."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve_worker.kv.prefix_cache import block_hashes, cache_salt
from pdserve_worker.router.prefix_routing import BalanceBound, PrefixHistory, RecentShare, choose_prefill

SALT = cache_salt("r", "float32", 4)


def test_longest_match_wins_within_the_bound() -> None:
    choice = choose_prefill(["p0", "p1", "p2"], {"p0": 1, "p1": 2, "p2": 2}, {"p1": 3, "p2": 5})
    assert (choice.worker_id, choice.matched_blocks, choice.reason) == ("p2", 5, "prefix")


def test_a_match_never_beats_the_bound() -> None:
    bound = BalanceBound(ratio=2.0, slack=1)
    choice = choose_prefill(["p0", "p1"], {"p0": 2, "p1": 5}, {"p1": 100}, bound=bound)
    assert (choice.worker_id, choice.reason) == ("p0", "least_loaded")
    assert choose_prefill(["p0", "p1"], {"p0": 2, "p1": 4}, {"p1": 1}, bound=bound).worker_id == "p1"
    # idle queues, but p1 took far more of the recent requests: its match does not count
    assert choose_prefill(["p0", "p1"], {}, {"p1": 9}, {"p0": 2, "p1": 9}, bound).worker_id == "p0"


def test_no_match_is_the_least_loaded_and_no_candidate_is_an_error() -> None:
    assert choose_prefill(["p1", "p0"], {"p1": 0, "p0": 3}, {}).worker_id == "p1"
    assert choose_prefill(["p0", "p1"], {}, {}, {"p0": 1}).worker_id == "p1"  # idle: the one we sent less
    with pytest.raises(ValueError):
        choose_prefill([], {}, {})
    with pytest.raises(ValueError):
        BalanceBound(ratio=0.5)


@given(
    st.lists(st.tuples(st.integers(0, 20), st.integers(0, 10), st.integers(0, 30)), min_size=1, max_size=6),
    st.floats(1, 4),
    st.integers(0, 4),
)
def test_the_choice_is_within_the_bound_and_has_the_best_match_there(specs, ratio, slack) -> None:
    ids = [f"p{i}" for i in range(len(specs))]
    queues = {w: q for w, (q, _, _) in zip(ids, specs)}
    matches = {w: m for w, (_, m, _) in zip(ids, specs)}
    recent = {w: r for w, (_, _, r) in zip(ids, specs)}
    ranked = sorted(ids, key=lambda w: (queues[w], w))
    bound = BalanceBound(ratio, slack)
    choice = choose_prefill(ranked, queues, matches, recent, bound)
    eligible = [
        w
        for w in ids
        if bound.allows(queues[w], min(queues.values())) and bound.allows(recent[w], min(recent.values()))
    ]
    if choice.reason == "prefix":
        assert choice.worker_id in eligible
        assert matches[choice.worker_id] == max(matches[w] for w in eligible)
    else:
        assert all(matches[w] == 0 for w in eligible)  # (or nobody is within both bounds)
        assert (queues[choice.worker_id], recent[choice.worker_id]) == min((queues[w], recent[w]) for w in ids)


def test_history_predicts_leading_blocks_and_is_bounded_tail_first() -> None:
    history = PrefixHistory(capacity_blocks=4)
    a = block_hashes(list(range(12)), 4, SALT)
    history.record("p0", a)
    assert history.match("p0", a) == 3 and history.match("p1", a) == 0
    b = block_hashes(list(range(100, 108)), 4, SALT)
    history.record("p0", b)
    assert history.size("p0") == 4
    assert history.match("p0", b) == 2 and history.match("p0", a) == 2  # a's tail went first
    history.forget("p0")
    assert history.match("p0", a) == 0


def test_interleaved_system_prompts_stick_to_their_prefill_and_load_stays_balanced() -> None:
    """The acceptance scenario in miniature: 2 prefills, 4 system prompts interleaved."""
    history = PrefixHistory(capacity_blocks=10_000)
    share = RecentShare(window=32)
    rng = random.Random(7)
    systems = [list(range(1000 * s, 1000 * s + 64)) for s in range(4)]
    served = {"p0": 0, "p1": 0}
    home: dict[int, str] = {}
    repeats = hits = 0
    for _ in range(200):
        s = rng.randrange(4)
        prompt = systems[s] + [rng.randrange(50_000) for _ in range(rng.randrange(1, 40))]
        hashes = block_hashes(prompt, 16, SALT)
        queues = {w: rng.randrange(2) for w in served}  # some queueing noise
        ranked = sorted(served, key=lambda w: (queues[w], w))
        choice = choose_prefill(ranked, queues, history.matches(ranked, hashes), share.counts())
        share.record(choice.worker_id)
        if s in home:
            repeats += 1
            hits += choice.worker_id == home[s]
        else:
            home[s] = choice.worker_id
        history.record(choice.worker_id, hashes)
        served[choice.worker_id] += 1
    assert hits / repeats >= 0.9
    assert max(served.values()) <= 2 * min(served.values())


def test_recent_share_counts_a_sliding_window() -> None:
    share = RecentShare(window=3)
    for w in ["a", "a", "b", "b", "b"]:
        share.record(w)
    assert share.counts() == {"b": 3}
