"""The attempt: one try of a request through a decode and a prefill (pd_backend.py has the road).

`run_attempt` reserves a slot, chooses whether a prefill pushes the prompt's KV or the decode
computes it itself (router/disaggregation.py), opens the decode's Generate, sends the prompt to
the prefill (when remote) and streams the decode's events as the client's; a draining decode's
handover moves the request (router/migration.py). A failure another worker may not repeat raises `Retryable`
(PDBackend.generate retries it, `note_retry`); every way out gives back an unfinished grant.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any, cast

import grpc

from pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve_common import tracing
from pdserve_common.logs import kv
from pdserve_common.membership import Member
from pdserve_worker.api import prompt_copies
from pdserve_worker.api.backend import (
    BackendError,
    BackendUnavailable,
    InvalidPrompt,
    RequestInfo,
    RequestTimeout,
    TokenEvent,
)
from pdserve_worker.api.metrics import RouterMetrics
from pdserve_worker.model.sampling.params import FinishReason, TokenLogprobs
from pdserve_worker.router.disaggregation import Road
from pdserve_worker.router.grants import Grants
from pdserve_worker.router.members import Members, NoMember, PrefillPick
from pdserve_worker.router.migration import MigrationFailed, migrate, note, push_targets
from pdserve_worker.router.placement import estimated_queue
from pdserve_worker.router.request import NO_CULPRIT, Retryable, RoutedRequest
from pdserve_worker.rpc.convert import finish_reason_from_proto, logprobs_from_proto, sampling_to_proto

log = logging.getLogger(__name__)


async def run_attempt(members: Members, grants: Grants, request: RoutedRequest) -> AsyncIterator[TokenEvent]:
    """One road through a decode and a prefill; failures a retry may cure raise `Retryable`.

    Everything that can fail without a worker (converting the parameters, choosing a
    prefill) happens before the Reserve; from the grant on, every way out (an error, a
    cancellation at any await, the client closing the stream) passes the `finally`, which
    either leaves the slot to a stream that finished or gives the grant back (`Grants.give_back`).
    The loop stays here, not in a generator of `Attempt`: closing this generator must run
    that `finally` at once, which a nested generator would leave to the garbage collector.
    """
    attempt = Attempt(members, grants, request)
    await attempt.reserve()
    # No await between this increment and the `try`: nothing can leave in between.
    members.inflight_decode[attempt.decode.worker_id] += 1
    try:
        attempt.choose()
        attempt.launch()
        while True:
            event = await attempt.next_event()
            if event.HasField("handover"):  # the decode is draining: move the request, KV and all
                await attempt.move(event.handover)
                continue
            token = await attempt.token_event(event)
            yield token
            if attempt.finished:  # its decode keeps the prompt's blocks: the next turn goes there
                members.note_decode_kept(attempt.decode.worker_id, attempt.tokens, request.cache_scope)
                return
    except BaseException as exc:
        mapped = attempt.failure(exc)
        if mapped is None:
            raise
        raise mapped from None
    finally:
        attempt.close()


def prefill_or_none(
    members: Members, request: RoutedRequest, tokens: list[int]
) -> tuple[PrefillPick | None, NoMember | None]:
    """The prefill for `tokens` (router/members.py), or why there is none where a decode may
    still compute the prompt itself (router/disaggregation.py); raises where it may not."""
    try:
        return members.pick_prefill_for(request.avoid, tokens, request.cache_scope), None
    except NoMember as exc:
        if members.disaggregation.policy == "always" or request.emitted or request.params.prompt_logprobs is not None:
            raise
        return None, exc


def note_retry(request: RoutedRequest, failure: Retryable, metrics: RouterMetrics | None) -> None:
    """Log, trace and count one resume (the next attempt span carries `pdserve.retry`)."""
    emitted = len(request.emitted)
    log.warning(
        kv(
            event="request_retry",
            request=request.request_id,
            retry=request.retries,
            failed=failure.worker_id,
            emitted=emitted,
            error=str(failure.error),
        )
    )
    now = tracing.now_ns()
    attributes = {
        "pdserve.retry": request.retries,
        "pdserve.failed.member": failure.worker_id,
        "pdserve.resumed_tokens": emitted,
        "error.message": str(failure.error),
    }
    tracing.record("router.resume", now, now, attributes)
    if metrics is not None:
        metrics.observe_retry()


def split_shared(grant: worker_pb2.Grant, copied: bool) -> tuple[int, int]:
    """A grant's shared blocks as (blocks of another copy of the prompt, tokens of the decode's
    prefix cache): the former hold a prompt another request is pushed; the latter ended requests' KV."""
    if copied:
        return grant.shared_blocks, 0
    return 0, grant.shared_blocks * grant.kv_layout.block_tokens


class Attempt:
    """The state of one `run_attempt`: the prefill and decode it holds, the grant, the two
    calls, what the client has been told, and the span; each step of the road is one method."""

    def __init__(self, members: Members, grants: Grants, request: RoutedRequest) -> None:
        self.members, self.grants, self.request = members, grants, request
        self.params = request.params  # this attempt's: a handover adds the seed it learned
        self.tokens = request.prompt_ids + request.emitted
        self.sampling = sampling_to_proto(self.params)  # max_tokens counts the emitted tokens too (worker.proto)
        # The prefill that would push (None: none is left, which only a local prefill survives).
        pick, self.no_prefill = prefill_or_none(members, request, self.tokens)
        self.prefill: Member | None = None if pick is None else pick.member
        self.cached_remote = 0 if pick is None else pick.cached_tokens  # tokens that prefill is predicted to hold
        self.note_prefill: Callable[[], None] = (lambda: None) if pick is None else pick.note
        self.local = False  # the decode computes the prompt itself (`choose`)
        self.copied = False  # the grant's shared blocks are another copy's (else the decode's prefix cache's)
        self.prefill_counted = False  # this attempt counts in the prefill's in-flight requests
        self.queue = 0  # the prefill's queue when chosen
        self.launched = 0.0
        self.call: Any = None  # the decode's Generate stream
        self.prefill_call: asyncio.Future[worker_pb2.PrefillReply] | None = None
        self.prompt_logprobs_sent = False
        self.info: RequestInfo | None = None
        self.finished = False
        self.migrations = 0
        # One span per attempt, ended by hand (this is a generator: tracing.py on spans across yields).
        self.span = tracing.start_span(
            "router.attempt",
            {
                "pdserve.request_id": request.request_id,
                "pdserve.retry": request.retries,
                "pdserve.resumed_tokens": len(request.emitted) or None,
            },
        )

    async def reserve(self) -> None:
        """KV on a decode; a failure here ends the span (no grant is held yet)."""
        request = self.request
        try:
            with tracing.use(self.span), tracing.span("router.reserve") as reserving:
                self.decode, self.grant, self.copied = await self.grants.reserve_prompt(
                    request.request_id,
                    self.tokens,
                    self.params.max_tokens - len(request.emitted),
                    request.avoid,
                    request.cache_scope,
                )
                reserving.set_attributes(
                    {
                        "pdserve.decode.member": self.decode.worker_id,
                        "pdserve.slot": self.grant.slot,
                        "pdserve.kv.shared_blocks": self.grant.shared_blocks or None,
                    }
                )
                prompt_copies.note_decode(self.decode.worker_id, self.grant.slot, self.grant.generation)
        except BaseException as exc:
            self.span.record_exception(exc)
            self.span.end()
            raise
        self.span.set_attributes(
            {
                "pdserve.decode.member": self.decode.worker_id,
                "pdserve.slot": self.grant.slot,
                "pdserve.slot.generation": self.grant.generation,
            }
        )

    def choose(self) -> None:
        """Remote or local prefill on the reserved decode (router/disaggregation.py); raises the
        NoMember of the missing prefill when the request cannot be computed on the decode."""
        members, request = self.members, self.request
        if self.prefill is not None:
            self.queue = estimated_queue(self.prefill, members.inflight_prefill[self.prefill.worker_id])
        request_road = Road(len(self.tokens), bool(request.emitted), self.params.prompt_logprobs is not None)
        copied, cached = split_shared(self.grant, self.copied)
        road = replace(request_road, shared_blocks=copied, decode_cached=cached, copies=prompt_copies.later_copies())
        running = max(self.decode.load.active_requests, members.inflight_decode[self.decode.worker_id] - 1)
        choice = members.disaggregation.choose(road, self.decode, self.prefill, self.cached_remote, self.queue, running)
        self.local = choice.local
        pushed_by = None if self.prefill is None or choice.local else self.prefill.worker_id
        attributes = {"pdserve.disaggregated": not choice.local, "pdserve.disaggregation.reason": choice.reason}
        self.span.set_attributes({**attributes, "pdserve.prefill.member": pushed_by})
        if members.metrics is not None:
            members.metrics.observe_disaggregation(choice.local, choice.reason)
        if not choice.local:
            if self.prefill is None:
                assert self.no_prefill is not None
                raise self.no_prefill
            members.inflight_prefill[self.prefill.worker_id] += 1
            self.prefill_counted = True
            self.note_prefill()

    def launch(self) -> None:
        """Open the decode's Generate stream, then (remote) send the prompt to the prefill."""
        request, timeouts = self.request, self.members.config.timeouts
        decode_stub = worker_pb2_grpc.DecodeStub(self.members.channel(self.decode))
        self.launched = time.monotonic()
        with tracing.use(self.span):  # both calls carry the attempt's traceparent (pdserve_common/channels.py)
            self.call = decode_stub.Generate(
                worker_pb2.GenerateRequest(
                    request_id=request.request_id,
                    slot=self.grant.slot,
                    generation=self.grant.generation,
                    prompt_token_ids=self.tokens,
                    sampling=self.sampling,
                    readiness_timeout_ms=timeouts.readiness_ms,
                    num_generated=len(request.emitted),
                    local_prefill=self.local,
                )
            )
            self.lost = self.members.lost.setdefault(self.decode.worker_id, asyncio.Event())
            if self.local:
                return
            assert self.prefill is not None
            prefill_stub = worker_pb2_grpc.PrefillStub(self.members.channel(self.prefill))
            self.prefill_call = asyncio.ensure_future(
                prefill_stub.Prefill(
                    worker_pb2.PrefillRequest(
                        request_id=request.request_id,
                        prompt_token_ids=self.tokens,
                        sampling=self.sampling,
                        targets=push_targets(self.grant),
                        num_generated=len(request.emitted),
                        cache_scope=request.cache_scope,
                    ),
                    timeout=timeouts.prefill_s,
                )
            )

    async def next_event(self) -> worker_pb2.TokenEvent:
        """The decode's next event; if the prefill fails first, its error (the decode would wait in
        vain); if the decode is found lost first, a retryable failure (its stream may never end)."""
        prefill_call, decode_id, lost = self.prefill_call, self.decode.worker_id, self.lost
        read = asyncio.ensure_future(self.call.read())
        lost_wait = asyncio.ensure_future(lost.wait())
        try:
            waiting = {read, lost_wait} | (set() if prefill_call is None or prefill_call.done() else {prefill_call})
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if not read.done() and lost.is_set():
                read.cancel()
                raise Retryable(
                    decode_id, BackendUnavailable(f"decode {decode_id} left the membership and does not answer")
                )
            if (
                prefill_call is not None
                and prefill_call.done()
                and not read.done()
                and (prefill_call.cancelled() or prefill_call.exception())
            ):
                read.cancel()
                assert self.prefill is not None
                await prefill_reply(prefill_call, self.prefill.worker_id, self.members)  # raises the mapped error
        finally:
            lost_wait.cancel()
        event = await read
        if event is grpc.aio.EOF:
            raise Retryable(decode_id, BackendError(f"decode {decode_id} ended the stream without a finish reason"))
        return cast(worker_pb2.TokenEvent, event)

    async def move(self, handover: worker_pb2.Handover) -> None:
        """The decode is draining: move the request to another decode (router/migration.py)."""
        members, request = self.members, self.request
        request.seeds.append(handover.seed)
        if self.params.seed is None:
            self.params = self.params.model_copy(update={"seed": handover.seed})
        source = self.decode
        try:
            # In the attempt's trace; the calls carry its traceparent (pdserve_common/channels.py).
            with (
                tracing.use(self.span),
                tracing.span(
                    "router.migrate",
                    {"pdserve.source.member": source.worker_id, "pdserve.resumed_tokens": len(request.emitted)},
                ) as moving,
            ):
                moved = await migrate(self.grants, request, self.params, source, self.grant, handover)
                moving.set_attributes(
                    {"pdserve.decode.member": moved.decode.worker_id, "pdserve.kv_bytes": moved.kv_bytes}
                )
        except MigrationFailed as exc:
            note(members.metrics, request.request_id, source.worker_id, None, exc)
            raise Retryable(source.worker_id, exc) from None
        note(members.metrics, request.request_id, source.worker_id, moved)
        self.call.cancel()  # the source's stream is over; its KV was freed by the Migrate
        members.inflight_decode[source.worker_id] -= 1
        members.inflight_decode[moved.decode.worker_id] += 1
        self.decode, self.grant, self.call = moved.decode, moved.grant, moved.call
        self.lost = members.lost.setdefault(self.decode.worker_id, asyncio.Event())
        self.migrations += 1
        self.info = None  # the next event reports the new decode

    async def token_event(self, event: worker_pb2.TokenEvent) -> TokenEvent:
        """The client's event for the decode's; an abort is retryable. Sets `finished` before the
        caller yields: the router closes the generator as soon as it has the last event, and a
        finished request must not be cancelled or released."""
        decode_id = self.decode.worker_id
        try:
            reason = finish_reason_from_proto(event.finish_reason)
        except ValueError:
            reason = FinishReason.ABORT  # a newer decode's reason: not an answer we can give
        if reason is FinishReason.ABORT:
            raise Retryable(decode_id, BackendError(f"decode {decode_id} aborted request {self.request.request_id}"))
        logprobs = None
        if event.HasField("logprobs"):
            try:
                logprobs = logprobs_from_proto(event.logprobs)
            except ValueError as exc:
                raise Retryable(decode_id, BackendError(f"decode {decode_id}: {exc}")) from None
        attach = await self._request_info(event, reason)
        self.finished = reason is not None
        return TokenEvent(event.token_id, event.text, reason, attach, logprobs, await self._prompt_logprobs())

    async def _prompt_logprobs(self) -> tuple[TokenLogprobs, ...] | None:
        """The prompt's logprobs, from the prefill's reply, for the request's first event only."""
        if self.params.prompt_logprobs is None or self.request.emitted or self.prompt_logprobs_sent:
            return None
        assert self.prefill_call is not None and self.prefill is not None  # (choose: never local)
        reply = await prefill_reply(self.prefill_call, self.prefill.worker_id, self.members)
        self.prompt_logprobs_sent = True
        try:
            return tuple(logprobs_from_proto(entry) for entry in reply.prompt_logprobs)
        except ValueError as exc:
            raise BackendError(f"prefill {self.prefill.worker_id}: prompt {exc}") from None

    async def _request_info(self, event: worker_pb2.TokenEvent, reason: FinishReason | None) -> RequestInfo | None:
        """Which workers served the request and what the KV cost: attached to one event."""
        if self.info is not None:
            return None
        prefill_id = None if self.local or self.prefill is None else self.prefill.worker_id
        ids = (prefill_id, self.decode.worker_id, self.request.retries)
        if self.migrations:  # the first event of the decode the request moved to
            self.info = RequestInfo(True, event.kv_bytes_received, None, *ids, migrations=self.migrations)
            return self.info
        decode_cached = split_shared(self.grant, self.copied)[1]
        if self.local:  # computed on the decode: nothing was pushed
            self.info = RequestInfo(False, 0, None, *ids, decode_cached)
            return self.info
        assert self.prefill_call is not None and self.prefill is not None
        if event.index == len(self.request.emitted) and self.launched:
            uncached = max(len(self.tokens) - self.cached_remote, 1)
            self.members.disaggregation.observe_remote(
                time.monotonic() - self.launched, uncached, self.queue, self.prefill
            )
            self.launched = 0.0
        if self.prefill_call.done() or reason is not None:
            # The prefill's reply has the push's figures; at the latest the last token waits for it.
            reply = await prefill_reply(self.prefill_call, self.prefill.worker_id, self.members)
            cached = max(reply.cached_tokens, decode_cached)  # (the decode's blocks were not pushed)
            self.info = RequestInfo(True, reply.kv_bytes, reply.push_seconds, *ids, cached)
            return self.info
        if event.index == len(self.request.emitted):
            return RequestInfo(event.kv_pushed, event.kv_bytes_received, None, *ids)
        return None

    def failure(self, exc: BaseException) -> BaseException | None:
        """What to raise for `exc` (None: re-raise it as it is)."""
        if not self.finished:
            self.span.record_exception(exc)
        if isinstance(exc, Retryable):
            self.stamp(exc)
        if not isinstance(exc, grpc.aio.AioRpcError):
            return None
        error = decode_error(exc, self.decode.worker_id, self.request.request_id)
        if exc.code() == grpc.StatusCode.DATA_LOSS:  # the KV failed its digest on the way: tried again as it is
            return Retryable(NO_CULPRIT, error)
        if self.local and exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
            # The decode no longer computes prompts (its registration was stale): another road.
            return self.stamp(Retryable(self.decode.worker_id, error))
        if exc.code() in _RETRYABLE_DECODE:
            # The decode's readiness wait timing out means the prefill never delivered; an
            # ABORTED Generate, that what it delivered cannot be used (a bad or partial push).
            # A migrated KV came from no prefill, nor did a locally computed one.
            at_prefill = exc.code() in _PREFILL_AT_FAULT and not self.migrations and not self.local
            culprit = self.prefill.worker_id if at_prefill and self.prefill is not None else self.decode.worker_id
            return self.stamp(Retryable(culprit, error))
        return error

    def stamp(self, failure: Retryable) -> Retryable:
        """Name the instance that failed (its registration): the request avoids that one, not
        the same worker restarted, and waits for it to come back when it went away."""
        for member in (self.decode, self.prefill):
            if member is not None and failure.member is None and member.worker_id == failure.worker_id:
                failure.member = member
        return failure

    def close(self) -> None:
        """Every way out: end the span, count the workers free, give back an unfinished grant."""
        members = self.members
        self.span.set_attribute("pdserve.finished", self.finished)
        self.span.end()
        members.inflight_decode[self.decode.worker_id] -= 1
        if self.prefill is not None and self.prefill_counted:
            members.inflight_prefill[self.prefill.worker_id] -= 1
        if not self.finished:
            if self.call is not None:
                self.call.cancel()  # a committed slot is freed by the decode once its request leaves the batch
            members.spawn(
                self.grants.give_back(self.decode, self.grant, self.request.request_id, self.prefill, self.prefill_call)
            )


async def prefill_reply(
    prefill_call: asyncio.Future[worker_pb2.PrefillReply], prefill_id: str, members: Members
) -> worker_pb2.PrefillReply:
    """The prefill's reply, or its failure as the request should see it (retryable or not)."""
    try:
        return await prefill_call
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if not prefill_call.cancelled() or (task is not None and task.cancelling()):
            raise  # this request itself is being cancelled (the client left)
        # gRPC ends a call whose channel we closed (its member left the membership) as
        # cancelled, not as an RpcError: that prefill is gone, another can take the prompt.
        raise Retryable(
            prefill_id, BackendUnavailable(f"prefill {prefill_id} went away mid-call (its channel was closed)")
        ) from None
    except grpc.aio.AioRpcError as exc:
        code = exc.code()
        if members.metrics is not None:
            members.metrics.observe_prefill_failure(code.name)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            prefill_s = members.config.timeouts.prefill_s
            raise Retryable(
                prefill_id, RequestTimeout(f"prefill {prefill_id} did not finish in {prefill_s:g}s")
            ) from None
        if code == grpc.StatusCode.UNAVAILABLE:
            raise Retryable(prefill_id, BackendUnavailable(f"prefill {prefill_id} failed: {exc.details()}")) from None
        if code == grpc.StatusCode.INVALID_ARGUMENT:  # the request's own input (its grammar): a 400, not retried
            raise InvalidPrompt(
                exc.details() or "the request was refused", public=True
            ) from None  # (names no worker: the client reads it)
        raise BackendError(f"prefill {prefill_id} failed: {code.name}: {exc.details()}") from None


# UNAVAILABLE: the decode went away (killed, network) or a member of its group did; INTERNAL:
# its generation loop failed; DEADLINE_EXCEEDED: its readiness wait ended without the prefill's
# notification; ABORTED: the notification that came cannot be used (malformed, for another
# prompt length, a group's members disagree).
_RETRYABLE_DECODE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED}
)
_PREFILL_AT_FAULT = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED})


def decode_error(exc: grpc.aio.AioRpcError, decode_id: str, request_id: str) -> BackendError:
    code, details = exc.code(), exc.details()
    where = f"decode {decode_id} (request {request_id})"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return RequestTimeout(f"{where}: {details}")
    if code == grpc.StatusCode.UNAVAILABLE:
        return BackendUnavailable(f"{where} is unavailable: {details}")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidPrompt(f"{where}: {details}")
    return BackendError(f"{where}: {code.name}: {details}")
