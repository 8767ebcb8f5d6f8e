"""One request on its way through the router: the state that crosses its attempts.

A `RoutedRequest` is made once per `PDBackend.generate` and handed to every attempt: the
client's prompt and parameters, the tokens already streamed (a retry re-prefills them after
the prompt), the worker instances it failed on (never tried again; the same worker restarted
is a new instance), the retries counted so far and the seeds learned from handovers. A
failure one worker may not repeat is a `Retryable`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdserve_common.membership import Member, Role
from pdserve_worker.api.backend import BackendError, BackendUnavailable
from pdserve_worker.model.sampling.params import SamplingParams

NO_CULPRIT = ""  # a failure no worker is avoided for (KV damaged on its way: transfer/digest.py)


class Retryable(Exception):
    """A failure of one worker that another may not have: `error` is raised if no retry is left.
    `member` is the registration the attempt used (router/attempt.py fills it in): which
    instance failed, and of which role."""

    def __init__(self, worker_id: str, error: BackendError) -> None:
        super().__init__(str(error))
        self.worker_id = worker_id
        self.error = error
        self.member: Member | None = None


@dataclass
class RoutedRequest:
    """`emitted` grows as tokens reach the client; `avoid` as workers fail it (worker id -> the
    `registered_unix_ms` of the instance that failed, 0: any); `seeds` holds the seed each
    draining decode handed over (a request without one got it there)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    cache_scope: str
    emitted: list[int] = field(default_factory=list)
    avoid: dict[str, int] = field(default_factory=dict)
    retries: int = 0
    seeds: list[int] = field(default_factory=list)
    failure: Retryable | None = None  # the last retryable failure: what the client hears of if none is left
    resume_deadline: float = 0.0  # a retry waits for a free slot until then
    member_deadline: float = 0.0  # a request waits for a member to (re)join until then
    return_deadline: float = 0.0  # a request whose worker went away waits for it to come back until then

    def resume_seed(self) -> None:
        """A resume samples as the source did: with the seed the last handover named."""
        if self.seeds and self.params.seed is None:
            self.params = self.params.model_copy(update={"seed": self.seeds[-1]})

    def failed(self, failure: Retryable, max_retries: int, resume_wait_s: float) -> None:
        """Count one failed attempt; raises its error when no retry is left."""
        self.failure = failure
        self.resume_deadline = time.monotonic() + resume_wait_s
        self.retries += 1
        if self.retries > max_retries:
            raise failure.error from None
        if failure.worker_id != NO_CULPRIT:
            self.avoid[failure.worker_id] = failure.member.registered_unix_ms if failure.member is not None else 0

    def lost_worker_of(self, role: Role) -> bool:
        """Whether the last failure was a worker of `role` going away (killed, unreachable): a
        restart may bring it back as a new instance, worth waiting for (PDBackend)."""
        failure = self.failure
        if failure is None or failure.member is None or failure.member.role is not role:
            return False
        return isinstance(failure.error, BackendUnavailable)
