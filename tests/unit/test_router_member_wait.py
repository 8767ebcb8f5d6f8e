"""A request that finds no prefill (decode) registered waits `member_wait_s` for one to join
before its 503: across a broker restart, or while every prefill restarts, requests were
answered 503 by the dozen within a second (benchmarks/soak.py at twice the fault rate)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest

from pdserve_common.membership import Load, Member, MemberInfo, Role
from pdserve_worker.api.metrics import RouterMetrics
from pdserve_worker.model.sampling.params import SamplingParams
from pdserve_worker.router.config import RouterConfig, Timeouts
from pdserve_worker.router.members import NoMember
from pdserve_worker.router.pd_backend import PDBackend

REV = "r1"


def backend(wait_s: float, disaggregation: str = "always") -> PDBackend:
    pd = PDBackend(
        RouterConfig(
            model_name="m",
            max_model_len=4096,
            revision=REV,
            token="t",
            timeouts=Timeouts(member_wait_s=wait_s),
            disaggregation=disaggregation,
        ),
        tokenizer=None,
        broker=None,
        metrics=RouterMetrics(),
    )
    pd.members._view = SimpleNamespace(members={}, connected=True)  # type: ignore[assignment]
    return pd


async def drain(pd: PDBackend) -> None:
    async for _ in pd.generate([1, 2, 3], SamplingParams(max_tokens=4), "req-1", cache_scope="s"):
        pass


@pytest.mark.asyncio
async def test_none_registered_waits_then_answers_unavailable() -> None:
    started = time.monotonic()
    with pytest.raises(NoMember, match="no prefill worker of model revision r1 is registered"):
        await drain(backend(0.4))
    assert time.monotonic() - started >= 0.4


@pytest.mark.asyncio
async def test_without_a_prefill_auto_looks_for_a_decode_that_computes_the_prompt_itself() -> None:
    """`auto` (router/disaggregation.py) serves a request on a decode when no prefill is left:
    with none of either registered, what it waits for and names is the decode."""
    started = time.monotonic()
    with pytest.raises(NoMember, match="no decode worker of model revision r1 is registered"):
        await drain(backend(0.4, "auto"))
    assert time.monotonic() - started >= 0.4


@pytest.mark.asyncio
async def test_a_member_that_joins_meanwhile_is_used() -> None:
    pd = backend(0.8)

    async def join() -> None:
        await asyncio.sleep(0.2)
        info = MemberInfo(worker_id="prefill-0", role=Role.PREFILL, grpc_endpoint="prefill-0:1", revision=REV)
        pd.members._view.members["prefill-0"] = Member(info, load=Load())  # type: ignore[union-attr]

    joining = asyncio.ensure_future(join())
    # The prefill that joined was taken: what is missing now is a decode (and no call was made).
    with pytest.raises(NoMember, match="no decode worker"):
        await drain(pd)
    await joining


@pytest.mark.asyncio
async def test_only_failed_members_left_fails_now_unless_one_left_lately() -> None:
    """The registered prefill failed this request (it stays avoided): waiting is worth it only
    when another one left a moment ago (restarting), not when it is all the deployment has."""
    from pdserve_worker.api.backend import BackendUnavailable
    from pdserve_worker.router.members import none_left

    only = [Member(MemberInfo(worker_id="prefill-0", role=Role.PREFILL, revision=REV), load=Load())]
    alone = none_left(Role.PREFILL, REV, only, departed=False)
    assert isinstance(alone, BackendUnavailable) and "but the failed prefill-0" in str(alone)
    assert not alone.worth_waiting and not alone.departed
    assert none_left(Role.PREFILL, REV, only, departed=True).worth_waiting
    assert none_left(Role.PREFILL, REV, only, departed=True).departed  # (PDBackend: the return wait)
    assert none_left(Role.PREFILL, REV, [], departed=False).worth_waiting


def test_departures_are_remembered_for_a_window_and_forgotten_on_return() -> None:
    from pdserve_worker.router.departures import Departures

    now = [0.0]
    d = Departures(window_s=60.0, clock=lambda: now[0])
    assert not d.recent(Role.PREFILL)
    d.left(Role.PREFILL, "prefill-1")
    assert d.recent(Role.PREFILL) and not d.recent(Role.DECODE)
    d.joined(Role.PREFILL, "prefill-1")  # back as itself
    assert not d.recent(Role.PREFILL)
    d.left(Role.PREFILL, "prefill-7f9c")  # a Deployment pod: it comes back under another name
    now[0] = 61.0
    assert not d.recent(Role.PREFILL)  # past the window: forgotten (and dropped)
    assert d._left[Role.PREFILL] == {}


def decode_member(registered_ms: int) -> Member:
    info = MemberInfo(worker_id="decode-0", role=Role.DECODE, grpc_endpoint="decode-0:1", revision=REV)
    return Member(info, load=Load(slots_free=4), registered_unix_ms=registered_ms)


def test_a_failed_instance_is_avoided_but_the_same_worker_restarted_is_not() -> None:
    from pdserve_worker.router.members import excluding

    old, restarted = decode_member(1000), decode_member(2000)
    assert excluding([old], {"decode-0": 1000}) == []
    assert excluding([restarted], {"decode-0": 1000}) == [restarted]
    assert excluding([restarted], {"decode-0": 0}) == []  # 0: every instance of it (a migration's source)


def lost_decode(request_id: str, error: Exception) -> Any:
    """A request whose only decode (instance 1000) failed with `error` after 3 tokens."""
    from pdserve_worker.router.request import Retryable, RoutedRequest

    request = RoutedRequest(request_id, [1, 2], SamplingParams(max_tokens=8), "s", emitted=[5, 6, 7])
    failure = Retryable("decode-0", error)
    failure.member = decode_member(1000)
    request.failed(failure, max_retries=2, resume_wait_s=1.0)
    return request


@pytest.mark.asyncio
async def test_a_request_whose_only_decode_died_waits_for_it_to_come_back() -> None:
    """#58 A7: the decode a stream was on was killed; it is the only one, still registered (its
    lease has not lapsed). The request waits, and goes on once the decode registered anew."""
    from pdserve_worker.api.backend import BackendUnavailable
    from pdserve_worker.router.members import none_left

    pd = backend(0.1)  # (member_wait_s: not the bound that applies here)
    pd._t = Timeouts(member_wait_s=0.1, return_wait_s=5.0)
    pd.members._view.members["decode-0"] = decode_member(1000)  # type: ignore[union-attr]
    request = lost_decode("req-2", BackendUnavailable("decode decode-0 is unavailable"))
    assert request.avoid == {"decode-0": 1000}
    with pytest.raises(NoMember):
        pd.members.ranked(Role.DECODE, request.avoid)  # the dead instance is all there is

    async def restart() -> None:
        await asyncio.sleep(0.5)
        pd.members._view.members["decode-0"] = decode_member(2000)  # type: ignore[union-attr]

    restarting = asyncio.ensure_future(restart())
    started = time.monotonic()
    none = none_left(Role.DECODE, REV, [decode_member(1000)], departed=False)
    assert await pd._waited(request, none) is True
    assert 0.4 <= time.monotonic() - started < 4.0
    assert [m.registered_unix_ms for m in pd.members.ranked(Role.DECODE, request.avoid)] == [2000]
    await restarting


@pytest.mark.asyncio
async def test_past_the_return_wait_the_error_names_the_wait() -> None:
    from pdserve_worker.api.backend import BackendUnavailable
    from pdserve_worker.api.errors import public_message
    from pdserve_worker.router.members import none_left

    pd = backend(0.1)
    pd._t = Timeouts(member_wait_s=0.1, return_wait_s=0.6)
    pd.members._view.members["decode-0"] = decode_member(1000)  # type: ignore[union-attr]
    request = lost_decode("req-3", BackendUnavailable("decode decode-0 is unavailable"))
    none = none_left(Role.DECODE, REV, [decode_member(1000)], departed=False)
    started = time.monotonic()
    with pytest.raises(BackendUnavailable) as caught:
        await pd._waited(request, none)
    assert time.monotonic() - started >= 0.6
    text = public_message(caught.value, "req-3")
    assert "went away and none came back" in text and "(0.6 s, PDSERVE_RETURN_WAIT_SECONDS)" in text
    assert "3 tokens had been streamed" in text
    assert "decode-0" not in text  # (no worker's name reaches the client)


@pytest.mark.asyncio
async def test_a_decode_that_failed_otherwise_is_not_waited_for() -> None:
    """A decode that answered with a timeout did not go away: its restart is not coming, and
    the request fails at once with that failure."""
    from pdserve_worker.api.backend import RequestTimeout
    from pdserve_worker.router.members import none_left

    pd = backend(0.1)
    pd._t = Timeouts(member_wait_s=0.1, return_wait_s=30.0)
    pd.members._view.members["decode-0"] = decode_member(1000)  # type: ignore[union-attr]
    request = lost_decode("req-4", RequestTimeout("decode decode-0: readiness wait over"))
    none = none_left(Role.DECODE, REV, [decode_member(1000)], departed=False)
    started = time.monotonic()
    with pytest.raises(RequestTimeout, match="readiness wait over; no other worker could take"):
        await pd._waited(request, none)
    assert time.monotonic() - started < 1.0


def test_the_return_wait_is_read_from_the_setting_its_error_names() -> None:
    from pdserve_worker.router.config import RETURN_WAIT_SETTING
    from pdserve_worker.serving import settings

    assert settings.RETURN_WAIT_S == RETURN_WAIT_SETTING
