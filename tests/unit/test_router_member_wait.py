"""A request that finds no prefill (decode) registered waits `member_wait_s` for one to join
before its 503: across a broker restart, or while every prefill restarts, requests were
answered 503 by the dozen within a second (benchmarks/soak.py at twice the fault rate)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from pdserve_common.membership import Load, Member, MemberInfo, Role
from pdserve_worker.api.metrics import RouterMetrics
from pdserve_worker.model.sampling.params import SamplingParams
from pdserve_worker.router.config import RouterConfig, Timeouts
from pdserve_worker.router.members import NoMember
from pdserve_worker.router.pd_backend import PDBackend

REV = "r1"


def backend(wait_s: float) -> PDBackend:
    pd = PDBackend(
        RouterConfig(
            model_name="m",
            max_model_len=4096,
            revision=REV,
            token="t",
            timeouts=Timeouts(member_wait_s=wait_s),
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
    assert type(alone) is BackendUnavailable and "but the failed prefill-0" in str(alone)
    assert isinstance(none_left(Role.PREFILL, REV, only, departed=True), NoMember)
    assert isinstance(none_left(Role.PREFILL, REV, [], departed=False), NoMember)


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
