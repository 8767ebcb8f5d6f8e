"""The router's conditional disaggregation (router/disaggregation.py): what each policy chooses,
the estimate `auto` compares, and what is never computed on a decode."""

from __future__ import annotations

import pytest

from pdserve_common.membership import Load, Member, MemberInfo, Role
from pdserve_worker.router.disaggregation import Disaggregation, Road


def decode(local: bool = True, chunk: int = 512, step_s: float = 0.05, rate: float = 0.0, running: int = 0) -> Member:
    info = MemberInfo("d0", Role.DECODE, local_prefill=local, prefill_chunk_tokens=chunk if local else 0)
    return Member(info, load=Load(step_seconds=step_s, prefill_tokens_per_s=rate, active_requests=running))


def prefill(rate: float = 1000.0) -> Member:
    return Member(MemberInfo("p0", Role.PREFILL), load=Load(prefill_tokens_per_s=rate))


def road(tokens: int = 100, resumed: bool = False, logprobs: bool = False, shared: int = 0, copies: int = 0) -> Road:
    return Road(tokens, resumed, logprobs, shared, copies)


def choose(auto: Disaggregation, r: Road, d: Member, p: Member | None, cached: int = 0, queue: int = 0):
    return auto.choose(r, d, p, cached, queue, d.load.active_requests)


def test_always_pushes_and_never_computes_on_the_decode() -> None:
    assert not choose(Disaggregation("always"), road(), decode(), prefill(), 0, 0).local
    chosen = choose(Disaggregation("never"), road(5000), decode(running=3), prefill(), 0, 0)
    assert chosen.local and chosen.reason == "policy"


@pytest.mark.parametrize(
    ("what", "r", "d"),
    [
        ("resumed", road(resumed=True), decode()),
        ("prompt logprobs", road(logprobs=True), decode()),
        ("shared blocks", road(shared=2), decode()),
        ("later copies of its prompt", road(copies=3), decode()),
        ("a decode that does not prefill", road(), decode(local=False)),
    ],
)
def test_what_a_decode_never_computes_goes_to_a_prefill_under_every_policy(what: str, r: Road, d: Member) -> None:
    for policy in ("never", "auto"):
        chosen = choose(Disaggregation(policy), r, d, prefill())
        assert not chosen.local and chosen.reason == "unable", (what, policy)


def test_no_prefill_left_computes_locally_unless_always() -> None:
    assert choose(Disaggregation("auto"), road(), decode(), None, 0, 0).reason == "no_prefill"
    assert choose(Disaggregation("never"), road(), decode(), None, 0, 0).local
    assert not choose(Disaggregation("auto"), road(resumed=True), decode(), None, 0, 0).local


def test_auto_pushes_until_the_workers_report_their_costs() -> None:
    auto = Disaggregation("auto")
    assert choose(auto, road(), decode(step_s=0.0), prefill(), 0, 0).reason == "unmeasured"
    assert choose(auto, road(), decode(), prefill(rate=0.0), 0, 0).reason == "unmeasured"


def test_auto_compares_the_remote_overhead_and_queue_with_the_decodes_steps() -> None:
    """remote = hop + (queue + 1) x uncached / rate; local = ceil(n / chunk) x step + n / local rate."""
    auto = Disaggregation("auto")
    auto.hop_s["p0"] = 0.2
    short = choose(auto, road(100), decode(step_s=0.05), prefill(rate=1000.0), 0, 0)
    assert short.local and short.remote_s == pytest.approx(0.3) and short.local_s == pytest.approx(0.15)
    auto.hop_s["p0"] = 0.01  # a cheap hop: the push wins (the decode's step is the dearer part)
    assert not choose(auto, road(100), decode(step_s=0.05), prefill(rate=1000.0), 0, 0).local
    queued = choose(auto, road(100), decode(step_s=0.05), prefill(rate=1000.0), 0, 3)  # 3 ahead at the prefill
    assert queued.local and queued.remote_s == pytest.approx(0.41)
    cached = choose(auto, road(2000), decode(step_s=0.001, chunk=4096), prefill(rate=1000.0), 1990, 0)
    assert not cached.local and cached.remote_s == pytest.approx(0.02)  # the prefill holds the prefix


def test_auto_keeps_long_prompts_off_a_decode_with_running_streams() -> None:
    auto = Disaggregation("auto")
    auto.hop_s["p0"] = 10.0  # local would be sooner, but each running stream would wait one chunk per step
    assert choose(auto, road(513), decode(running=1), prefill(), 0, 0).reason == "running"
    assert choose(auto, road(512), decode(running=1), prefill(), 0, 0).local
    assert choose(auto, road(4000), decode(running=0), prefill(), 0, 0).local


def test_the_remote_overhead_is_what_the_prefills_compute_does_not_explain() -> None:
    auto = Disaggregation("auto")
    auto.observe_remote(0.5, 200, 0, prefill(rate=1000.0))
    assert auto.hop_s == {"p0": pytest.approx(0.3)}
    auto.observe_remote(0.1, 200, 0, prefill(rate=1000.0))  # faster than its compute: no overhead
    assert auto.hop_s["p0"] == pytest.approx(0.8 * 0.3)
    auto.observe_remote(float("inf"), 200, 0, prefill(rate=1000.0))  # nonsense is ignored
    auto.observe_remote(0.5, 200, 0, prefill(rate=0.0))
    assert auto.hop_s["p0"] == pytest.approx(0.8 * 0.3)
    auto.forget("p0")  # the prefill left: what was measured of it goes
    assert auto.hop_s == {}


def test_a_misreported_rate_is_read_within_a_plausible_band() -> None:
    """A prefill claiming 1e300 tokens/s is read as 1e7; one claiming a fraction of a token, as
    not measured (the choice pushes, as before any report)."""
    auto = Disaggregation("auto")
    auto.hop_s["p0"] = 0.0
    huge = choose(auto, road(1000), decode(step_s=0.05, rate=1000.0), prefill(rate=1e300))
    assert huge.remote_s == pytest.approx(1000 / 1e7)
    assert choose(auto, road(1000), decode(), prefill(rate=0.5)).reason == "unmeasured"


def test_the_routers_own_count_of_running_streams_counts_too() -> None:
    """A burst to a decode whose last report said idle: the router's in-flight count says otherwise."""
    auto = Disaggregation("auto")
    auto.hop_s["p0"] = 10.0
    assert auto.choose(road(4000), decode(running=0), prefill(), 0, 0, running=2).reason == "running"


def test_an_unknown_policy_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="disaggregation must be one of always, never, auto, got 'sometimes'"):
        Disaggregation("sometimes")
