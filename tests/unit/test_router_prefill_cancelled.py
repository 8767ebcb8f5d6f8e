"""A Prefill call that gRPC ends as *cancelled* (its channel was closed under it) is a prefill
that went away: retryable on another prefill, never an unhandled CancelledError (which the
soak saw as a bare HTTP 500). A request that is itself being cancelled (its client left) still
is cancelled."""

from __future__ import annotations

import asyncio

import pytest

from pdserve_worker.api.backend import BackendUnavailable
from pdserve_worker.api.metrics import RouterMetrics
from pdserve_worker.router.attempt import prefill_reply
from pdserve_worker.router.config import RouterConfig
from pdserve_worker.router.members import Members
from pdserve_worker.router.request import Retryable


def members() -> Members:
    return Members(RouterConfig(model_name="m", max_model_len=64, revision="r", token="t"), RouterMetrics())


@pytest.mark.asyncio
async def test_a_cancelled_prefill_call_is_a_retryable_unavailable_prefill() -> None:
    call: asyncio.Future[object] = asyncio.get_running_loop().create_future()
    call.cancel()  # what grpc.aio's call becomes when its channel closes mid-call
    with pytest.raises(Retryable) as caught:
        await prefill_reply(call, "prefill-0", members())  # type: ignore[arg-type]
    assert caught.value.worker_id == "prefill-0"
    assert isinstance(caught.value.error, BackendUnavailable)
    assert "prefill-0 went away mid-call" in str(caught.value.error)


@pytest.mark.asyncio
async def test_the_request_itself_cancelled_stays_cancelled() -> None:
    call: asyncio.Future[object] = asyncio.get_running_loop().create_future()
    waiting = asyncio.ensure_future(prefill_reply(call, "prefill-0", members()))  # type: ignore[arg-type]
    await asyncio.sleep(0)
    waiting.cancel()  # the client left: the request's task is cancelled, the call not (yet)
    with pytest.raises(asyncio.CancelledError):
        await waiting
