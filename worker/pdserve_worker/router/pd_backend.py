"""The router's PD backend: one request's road through a decode and a prefill worker.

Each try of a request is one attempt (router/attempt.py; worker.proto's header has the contract):
1. `Reserve` a slot on the best decode with one free (router/members.py ranks, router/grants.py asks);
2. open `Generate` there with the grant: it waits for the slot's KV;
3. meanwhile `Prefill` on the chosen prefill pushes the prompt's KV into the slot and notifies the decode;
4. stream the decode's tokens, with a `RequestInfo` saying how the KV arrived.
A failed worker is avoided and the request retried (`Timeouts.max_retries`) with the tokens
already streamed appended to the prompt, so the client's stream goes on without a gap; when it
went away and no other is left, the request waits for it to come back (`return_wait_s`).
Failures another worker would repeat end it. Every way out of an attempt cancels its calls and
gives its grant back. A draining decode hands its requests over (router/migration.py). Stop
strings are the decode's job: its text never contains one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from pdserve_common.logs import kv
from pdserve_common.membership import Role
from pdserve_worker.api.backend import BackendUnavailable, NoCapacity, TokenEvent
from pdserve_worker.api.metrics import RouterMetrics
from pdserve_worker.api.tokenizing import ModelTokenizing
from pdserve_worker.model.sampling.params import SamplingParams
from pdserve_worker.model.tokenizer import Tokenizer
from pdserve_worker.router.attempt import note_retry, run_attempt
from pdserve_worker.router.config import RETURN_WAIT_SETTING, RouterConfig
from pdserve_worker.router.grants import Grants
from pdserve_worker.router.members import Members, NoMember
from pdserve_worker.router.request import Retryable, RoutedRequest
from pdserve_worker.rpc.broker_client import BrokerClient
from pdserve_worker.rpc.broker_watch import MembershipView

log = logging.getLogger(__name__)


class PDBackend(ModelTokenizing):
    """`router.backend.Backend` over the broker's membership of prefill and decode workers."""

    def __init__(
        self, config: RouterConfig, *, tokenizer: Tokenizer, broker: BrokerClient, metrics: RouterMetrics | None = None
    ) -> None:
        self.config = config
        self.model_name = config.model_name
        self.max_model_len = config.max_model_len
        self.revision = config.revision
        self._tokenizer = tokenizer
        self._broker = broker
        self._metrics = metrics
        self._t = config.timeouts
        self.members = Members(config, metrics)
        self.grants = Grants(self.members)

    # ---- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Watch the decode and prefill membership (inside the event loop that serves requests)."""
        await self.members.watch(self._broker)

    async def close(self) -> None:
        await self.members.close()

    @property
    def view(self) -> MembershipView:
        return self.members.view

    def ready_members(self) -> dict[str, int]:
        """Members that could serve a request now, by role."""
        return self.members.ready()

    def in_flight(self) -> dict[str, int]:
        """Requests this router has on decodes and on prefills now (0 once they are all over)."""
        return self.members.in_flight()

    def health(self) -> dict[str, object]:
        """For the router's /health: whether requests can be served, and by how many members."""
        members = self.ready_members()
        return {
            "ready": members["prefill"] > 0 and members["decode"] > 0,
            "members": members,
            "in_flight": self.in_flight(),
            "broker_connected": self.members.connected,
        }

    @property
    def shares_prompt_prefill(self) -> bool:
        """Whether n copies of a prompt gain from following the first (api/prompt_copies.py)."""
        return self.members.shares_prompt_prefill

    # ---- one request ------------------------------------------------------------------------------

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str, *, cache_scope: str
    ) -> AsyncIterator[TokenEvent]:
        """Serve one request; a decode or prefill that fails midway is replaced (at most `max_retries` times).

        The tokens already streamed are kept: a retry re-prefills the prompt followed by them
        on another decode (`num_generated`), whose stream goes on at the next token, so the
        client sees one answer with no token repeated or lost.
        """
        request = RoutedRequest(request_id, prompt_ids, params, cache_scope)
        while True:
            request.resume_seed()
            try:
                async for event in run_attempt(self.members, self.grants, request):
                    if event.token_id is not None:
                        request.emitted.append(event.token_id)
                    yield event
                return
            except (NoCapacity, BackendUnavailable) as exc:
                if await self._waited(request, exc):
                    continue
            except Retryable as caught:
                request.failed(caught, self._t.max_retries, self._t.resume_wait_s)
                note_retry(request, caught, self._metrics)

    async def _waited(self, request: RoutedRequest, exc: NoCapacity | BackendUnavailable) -> bool:
        """Whether a request that found no worker to use waited for one (True: try again);
        raises what the client should hear when waiting is not worth it."""
        if isinstance(exc, NoMember) and (exc.departed or request.lost_worker_of(exc.role)):
            return await self._returned(request, exc.role)  # (or raises)
        if isinstance(exc, NoMember) and exc.worth_waiting:  # none to use: wait a while for one to (re)join
            request.member_deadline = request.member_deadline or time.monotonic() + self._t.member_wait_s
            if await self.members.joined(exc.role, request.avoid, request.member_deadline):
                return True
        failure = request.failure
        if failure is None:
            raise exc
        if isinstance(exc, NoCapacity) and time.monotonic() < request.resume_deadline:
            # A stream cannot be answered 429 midway: wait for a slot to come free.
            await asyncio.sleep(exc.retry_after_s)
            return True
        # A retry found no worker left: the failure that made it is what the client should hear of.
        raise type(failure.error)(
            f"{failure.error}; no other worker could take request {request.request_id} "
            f"over after {len(request.emitted)} tokens: {exc}"
        ) from None

    async def _returned(self, request: RoutedRequest, role: Role) -> bool:
        """A worker of `role` went away (this request's, or one that left lately) and no other
        is left: wait up to `return_wait_s` for one to register (the same one restarted counts:
        a new instance). True when one did; else an error that names the wait, for the client."""
        wait_s = self._t.return_wait_s
        if not request.return_deadline:
            request.return_deadline = time.monotonic() + wait_s
            log.warning(kv(event="request_waits_for_return", request=request.request_id, role=role, wait_s=wait_s))
        if await self.members.joined(role, request.avoid, request.return_deadline):
            request.return_deadline = 0.0  # a later loss waits again, in full
            return True
        failure = request.failure
        log.warning(
            kv(
                event="request_return_wait_over",
                request=request.request_id,
                role=role,
                error=None if failure is None else str(failure.error),
            )
        )
        raise BackendUnavailable(
            f"a {role} worker went away and none came back within the wait for one ({wait_s:g} s, "
            f"{RETURN_WAIT_SETTING}); {len(request.emitted)} tokens had been streamed",
            public=True,
        ) from None
