"""One queued prefill (`Job`) and its outcome: the result, or a failure marked with whether its
push is over (read by the servicer, rpc/trailers.py); `resolve` hands either to the waiting
coroutine exactly once, from the compute thread.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any

from pdserve_worker.kv.slots import Grant
from pdserve_worker.model.sampling.params import SamplingParams, TokenLogprobs
from pdserve_worker.transfer.push import KVPusher, PushError

JobKey = tuple[str, int, int]  # (request_id, slot, generation) of the request's first target


class PrefillCancelled(Exception):
    """The router cancelled this prefill (worker.proto's Prefill.Cancel)."""


class InstanceBroken(RuntimeError):
    """The tensor-parallel group of this instance broke (a rank died or hangs): the router tries
    another prefill (UNAVAILABLE), and this one restarts as one."""


@dataclass
class Job:
    """One queued prefill; its outcome is handed to `done` on the event loop `loop`."""

    request_id: str = ""
    prompt: list[int] = field(default_factory=list)
    params: SamplingParams | None = None
    targets: list[Grant] = field(default_factory=list)
    num_generated: int = 0
    accepted: float = 0.0
    loop: asyncio.AbstractEventLoop | None = None
    done: asyncio.Future | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    pusher: KVPusher | None = None
    settled: bool = False  # an outcome was handed to `done` (set on the compute thread)
    trace: Any = None  # the request's prefill span (tracing.py); children are timed on the compute thread
    cache_scope: str = ""  # which cached prefixes it may reuse (api/cache_scope.py)
    prefetch: Any = None  # its prefix blocks being read from the disk tier (PrefixStore.prefetch)
    prompt_states: Any = None  # the prompt's final hidden states, kept when it asks for prompt logprobs
    peer_bytes: int = 0  # KV bytes the other tensor-parallel ranks pushed for it

    @property
    def echo(self) -> bool:
        """It asks for its prompt's logprobs (a resume does not: the client has them already)."""
        return self.params is not None and self.params.prompt_logprobs is not None and self.num_generated == 0


@dataclass(frozen=True)
class PrefillResult:
    first_token: int
    num_tokens: int
    kv_bytes: int
    push_seconds: float
    prefill_seconds: float
    cached_tokens: int = 0
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()  # prompt tokens 1..n-1's, when asked for


def mark(exc: BaseException, settled: bool) -> BaseException:
    """Note on a prefill's failure whether its push is over (read by the servicer)."""
    exc.push_settled = settled  # type: ignore[attr-defined]
    return exc


def push_settled_of(exc: BaseException) -> bool:
    return bool(getattr(exc, "push_settled", False))


def fail(job: Job, exc: BaseException, settled: bool) -> None:
    resolve(job, mark(exc, settled))


def resolve(job: Job, outcome: PrefillResult | BaseException) -> None:
    """Hand the outcome to the waiting coroutine (if it still waits: a cancelled one does not)."""
    job.settled = True
    job.prompt_states = None  # (a view of its pass's states: every outcome lets go of it here)

    def settle() -> None:
        if job.done.done():
            return
        if isinstance(outcome, BaseException):
            job.done.set_exception(outcome)
        else:
            job.done.set_result(outcome)

    job.loop.call_soon_threadsafe(settle)


def quiesce(pusher: KVPusher) -> bool:
    """After a failure that was not the transfer's: wait for the puts already issued (bounded
    by the transfer timeout), then drop the push. True if none of them can still land."""
    try:
        pusher.flush()
        settled = True
    except (PushError, RuntimeError):
        settled = False
    pusher.abort()
    return settled
