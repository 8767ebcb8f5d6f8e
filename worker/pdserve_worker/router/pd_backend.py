"""The router's PD backend: one request's road through a decode and a prefill worker.

For each request (worker.proto's header has the contract):
1. rank the decodes of the broker's membership (`placement`), `Reserve` a slot on the best one
   that has a free slot (the next one on RESOURCE_EXHAUSTED or if it is away);
2. open `Generate` on that decode with the grant: it waits for the slot's KV;
3. meanwhile call `Prefill` on the least busy prefill with the grant as its target: it
   computes the prompt's KV, pushes it into the slot and notifies the decode, whose stream
   then starts with the first token (sampled by prefill);
4. stream the decode's tokens to the router, with a `RequestInfo` saying the KV arrived by
   push: the bytes and the push time (from the prefill's reply), prefill and decode ids.

Failures of a worker are retried (`Timeouts.max_retries`): a decode whose stream breaks
(killed, aborted) or a prefill that fails or never delivers (the decode's readiness wait
times out) is avoided, and the request takes the road again with the tokens already streamed
appended to the prompt (`num_generated`), so the client's stream continues without a gap.
Failures that another worker would repeat (a bad prompt, no free slot) end the request.

Each failed attempt is cleaned up: a failed prefill cancels the stream at once (the decode
would otherwise wait for a notification that never comes), and a request that ends early
for any reason (error, client gone, stop string) cancels its Generate, which frees the slot,
and sends a Release for the grant in case Generate never claimed it (idempotent).

A draining decode hands its requests over instead of failing them: its stream ends with a
`handover` event, and the request moves to another decode with its KV and no prefill
(router/migration.py); if that fails, it resumes as above.

Stop strings are the decode's job: it ends generation and frees the slot the moment one
matches, and its text never contains one (the router passes the text through).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Any, cast

import grpc

from pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve_common import tracing
from pdserve_common.auth import TLSConfig
from pdserve_common.channels import aio_channel
from pdserve_common.logs import kv
from pdserve_common.membership import EventType, Member, MemberEvent, Role
from pdserve_worker.api import prompt_copies
from pdserve_worker.api.backend import (
    BackendError,
    BackendUnavailable,
    InvalidPrompt,
    NoCapacity,
    RequestInfo,
    RequestTimeout,
    TokenEvent,
    capacity_held,
)
from pdserve_worker.api.metrics import RouterMetrics
from pdserve_worker.api.tokenizing import ModelTokenizing
from pdserve_worker.kv.block_events import MAX_EVENTS_PER_REPLY
from pdserve_worker.kv.prefix_cache import block_hashes, cache_salt, scoped_salt
from pdserve_worker.model.sampling.params import FinishReason, SamplingParams, TokenLogprobs
from pdserve_worker.model.tokenizer import Tokenizer
from pdserve_worker.router.departures import Departures
from pdserve_worker.router.kv_index import ReportedIndex
from pdserve_worker.router.migration import MigrationFailed, migrate, note, push_targets
from pdserve_worker.router.placement import compatible, estimated_queue, rank_decodes, rank_prefills
from pdserve_worker.router.prefix_routing import (
    BalanceBound,
    PrefillChoice,
    PrefixHistory,
    RecentShare,
    choose_prefill,
)
from pdserve_worker.rpc.broker_client import BrokerClient
from pdserve_worker.rpc.broker_watch import MembershipView
from pdserve_worker.rpc.channel_pool import ChannelPool
from pdserve_worker.rpc.convert import finish_reason_from_proto, logprobs_from_proto, sampling_to_proto
from pdserve_worker.rpc.trailers import never_sent, push_settled

log = logging.getLogger("pdserve.router.pd")

NO_CAPACITY_RETRY_S = 1.0
PREFIX_HISTORY_BLOCKS = 16_384  # per prefill: 262,144 tokens of 16-token blocks (about 1 MB of hashes)
CLOSE_WAIT_S = 2.0
BLOCK_EVENTS_POLL_S = 0.25  # how often a router pulls each prefill's block events (router/kv_index.py)
BLOCK_EVENTS_PAGES = 8  # replies taken from one prefill per round (a backlog takes several rounds)


MEMBER_POLL_S = 0.1  # how often a request waiting for a member looks at the membership again


class NoMember(BackendUnavailable):
    """No prefill (decode) that this request may use is registered right now."""

    def __init__(self, message: str, role: Role) -> None:
        super().__init__(message)
        self.role = role


@dataclass(frozen=True)
class Timeouts:
    rpc_s: float = 5.0  # Reserve, Release
    lease_ms: int = 30_000  # a grant lapses if Generate has not claimed it by then
    readiness_ms: int = 300_000  # how long the decode waits for the KV (prefill queueing included)
    prefill_s: float = 600.0  # deadline of one Prefill call
    max_retries: int = 2  # a request survives this many failed decode or prefill workers
    resume_wait_s: float = 10.0  # how long a retry waits for a free slot before giving up
    # How long a request waits for a prefill (decode) to be registered when none is (all
    # restarting, or the view emptied across a broker restart) before it is answered 503.
    member_wait_s: float = 10.0
    settle_s: float = 30.0  # how long an abandoned grant waits for the prefill to confirm its push ended


class PDBackend(ModelTokenizing):
    """`router.backend.Backend` over the broker's membership of prefill and decode workers."""

    def __init__(
        self,
        *,
        model_name: str,
        tokenizer: Tokenizer,
        max_model_len: int,
        revision: str,
        broker: BrokerClient,
        token: str,
        metrics: RouterMetrics | None = None,
        timeouts: Timeouts = Timeouts(),
        tls: TLSConfig | None = None,
        prefix_history_blocks: int = PREFIX_HISTORY_BLOCKS,
        prefix_block_tokens: int = 16,
        balance: BalanceBound = BalanceBound(),
        prefix_routing: str = "events",
    ) -> None:
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.revision = revision
        self._tokenizer = tokenizer
        self._broker = broker
        self._token = token
        self._metrics = metrics
        self._t = timeouts
        self._tls = tls  # how workers are dialled (settings.peer_tls)
        self._view: MembershipView | None = None
        self._channels = ChannelPool(token, tls, self.spawn, grace_s=timeouts.prefill_s)
        self._inflight_decode: Counter[str] = Counter()
        self._inflight_prefill: Counter[str] = Counter()
        self._departures = Departures()  # who left lately: worth waiting for when none is left
        self._background: set[asyncio.Task[None]] = set()
        # Set when a decode is found lost (left the membership and does not answer): its streams end.
        self._lost: dict[str, asyncio.Event] = {}
        # Prefix-aware prefill choice from this router's own routing history (0 blocks: off).
        self._prefixes = PrefixHistory(prefix_history_blocks) if prefix_history_blocks else None
        self._recent = RecentShare()
        self._balance = balance
        self._prefix_block_tokens = prefix_block_tokens
        # Only this router's own predictions use these hashes: the revision keeps two models apart.
        self._prefix_salt = cache_salt(revision, "router-prediction", prefix_block_tokens)
        # "events": what the prefills report they hold (router/kv_index.py), the prediction only
        # for a prefill that has not reported; "predict": the prediction alone.
        if prefix_routing not in ("events", "predict"):
            raise ValueError(f"prefix_routing must be 'events' or 'predict', got {prefix_routing!r}")
        self._reported = ReportedIndex() if prefix_routing == "events" and self._prefixes is not None else None
        self._follower: asyncio.Task[None] | None = None

    # ---- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Watch the decode and prefill membership (inside the event loop that serves requests)."""
        self._view = await self._broker.watch([Role.DECODE, Role.PREFILL], listener=self._on_member)
        if self._reported is not None:
            self._follower = asyncio.get_running_loop().create_task(self._follow_block_events())

    async def _follow_block_events(self) -> None:
        """Pull every prefill's block events into the index, BLOCK_EVENTS_POLL_S apart."""
        while True:
            for member in [m for m in self.view.members.values() if m.role is Role.PREFILL]:
                try:
                    await self._pull_block_events(member)
                except Exception as exc:  # noqa: BLE001 - one bad reply must not stop following the others
                    log.warning(kv(event="block_events_apply_failed", prefill=member.worker_id, error=repr(exc)))
                    if self._reported is not None:
                        self._reported.forget(member.worker_id)  # unknown again: the prediction stands in
            await asyncio.sleep(BLOCK_EVENTS_POLL_S)

    async def _pull_block_events(self, member: Member) -> None:
        assert self._reported is not None
        stub = worker_pb2_grpc.PrefillStub(self.channel(member))
        for _ in range(BLOCK_EVENTS_PAGES):  # a long backlog comes in pages; the rest next round
            epoch, after = self._reported.cursor(member.worker_id)
            try:
                reply = await stub.BlockEvents(
                    worker_pb2.BlockEventsRequest(epoch=epoch, after_seq=after), timeout=self._t.rpc_s
                )
            except grpc.aio.AioRpcError as exc:
                log.debug(kv(event="block_events_failed", prefill=member.worker_id, code=exc.code().name))
                return
            if member.worker_id not in self.view.members:
                return  # it left meanwhile: its entry was forgotten (a restart comes with a new epoch)
            self._reported.apply(member.worker_id, reply)
            if reply.reset or sum(len(r.block_hashes) for r in reply.runs) < MAX_EVENTS_PER_REPLY:
                return

    async def close(self) -> None:
        if self._follower is not None:
            self._follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._follower
        # Grants being given back get a moment to reach their decodes; past it, leases reclaim them.
        if self._background:
            await asyncio.wait(list(self._background), timeout=CLOSE_WAIT_S)
        for task in list(self._background):
            task.cancel()
        await self._channels.close()

    @property
    def view(self) -> MembershipView:
        if self._view is None:
            raise RuntimeError("PDBackend.start() was not awaited")
        return self._view

    def ready_members(self) -> dict[str, int]:
        """Members that could serve a request now, by role."""
        members = self.view.members.values() if self._view is not None else ()
        return {
            role.value: sum(1 for m in members if compatible(m, role, self.revision))
            for role in (Role.PREFILL, Role.DECODE)
        }

    def in_flight(self) -> dict[str, int]:
        """Requests this router has on decodes and on prefills now (0 once they are all over)."""
        return {"decode": sum(self._inflight_decode.values()), "prefill": sum(self._inflight_prefill.values())}

    def health(self) -> dict[str, object]:
        """For the router's /health: whether requests can be served, and by how many members."""
        members = self.ready_members()
        return {
            "ready": members["prefill"] > 0 and members["decode"] > 0,
            "members": members,
            "in_flight": self.in_flight(),
            "broker_connected": self._view is not None and self._view.connected,
        }

    def _on_member(self, event: MemberEvent) -> None:
        member = event.member
        if member is None:
            return
        if event.type is EventType.ADDED:
            self._departures.joined(member.role, member.worker_id)
        if event.type is EventType.REMOVED:
            self._departures.left(member.role, member.worker_id)
            if member.role is Role.PREFILL and self._prefixes is not None:
                self._prefixes.forget(member.worker_id)  # a prefill that comes back holds nothing
            if member.role is Role.PREFILL and self._reported is not None:
                self._reported.forget(member.worker_id)
            if member.role is Role.DECODE and self._metrics is not None:
                self._metrics.forget_decode(member.worker_id)
            if member.role is Role.DECODE and self._inflight_decode[member.worker_id] > 0:
                # Closing its channel now would cancel our streams there: the probe decides.
                self.spawn(self._probe_decode(member))
                return
            self._channels.forget(member.info.grpc_endpoint)
            return
        if member.role is Role.DECODE and self._metrics is not None:
            used = member.load.slots_used
            self._metrics.set_decode_slots(
                member.worker_id,
                used,
                max(member.info.slots_total - used, 0),
                member.load.kv_tokens_used,
                member.load.kv_tokens_total,
            )
        if member.info.revision != self.revision:
            log.warning(
                kv(
                    event="member_revision_mismatch",
                    worker=member.worker_id,
                    role=member.role,
                    revision=member.info.revision,
                    ours=self.revision,
                )
            )

    async def _probe_decode(self, member: Member) -> None:
        """A decode with our streams left the membership: if it does not answer either (frozen,
        or gone without closing its connections), its streams are given up and resumed
        elsewhere. One that answers keeps them: the broker may merely have restarted."""
        channel = aio_channel(member.info.grpc_endpoint, self._token, self._tls)
        try:
            await worker_pb2_grpc.DecodeStub(channel).Status(worker_pb2.StatusRequest(), timeout=self._t.rpc_s)
        except grpc.aio.AioRpcError as exc:
            log.warning(
                kv(
                    event="decode_lost",
                    decode=member.worker_id,
                    code=exc.code().name,
                    streams=self._inflight_decode[member.worker_id],
                )
            )
            self._lost.pop(member.worker_id, asyncio.Event()).set()
            await asyncio.sleep(0)  # the streams give up (and cancel their calls) before the channel closes
            self._channels.forget(member.info.grpc_endpoint, grace=False)
        finally:
            await channel.close()

    # ---- one request ------------------------------------------------------------------------------

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str, *, cache_scope: str
    ) -> AsyncIterator[TokenEvent]:
        """Serve one request; a decode or prefill that fails midway is replaced (at most `max_retries` times).

        The tokens already streamed are kept: a retry re-prefills the prompt followed by them
        on another decode (`num_generated`), whose stream goes on at the next token, so the
        client sees one answer with no token repeated or lost.
        """
        emitted: list[int] = []
        avoid: set[str] = set()
        retries = 0
        failure: _Retryable | None = None
        resume_deadline = member_deadline = 0.0
        seeds: list[int] = []  # the seed a draining decode handed over (a request without one got it there)
        while True:
            if seeds and params.seed is None:
                params = params.model_copy(update={"seed": seeds[-1]})  # a resume samples as the source did
            try:
                async for event in self._attempt(
                    prompt_ids, emitted, params, request_id, avoid, retries, seeds, cache_scope
                ):
                    if event.token_id is not None:
                        emitted.append(event.token_id)
                    yield event
                return
            except (NoCapacity, BackendUnavailable) as exc:
                if isinstance(exc, NoMember):  # none to use: wait a while for one to (re)join
                    member_deadline = member_deadline or time.monotonic() + self._t.member_wait_s
                    if await self._member_joined(exc.role, avoid, member_deadline):
                        continue
                if failure is None:
                    raise
                if isinstance(exc, NoCapacity) and time.monotonic() < resume_deadline:
                    # A stream cannot be answered 429 midway: wait for a slot to come free.
                    await asyncio.sleep(exc.retry_after_s)
                    continue
                # A retry found no worker left: the failure that made it is what the client should hear of.
                raise type(failure.error)(
                    f"{failure.error}; no other worker could take request {request_id} "
                    f"over after {len(emitted)} tokens: {exc}"
                ) from None
            except _Retryable as caught:
                failure = caught
                resume_deadline = time.monotonic() + self._t.resume_wait_s
                retries += 1
                if retries > self._t.max_retries:
                    raise failure.error from None
                avoid.add(failure.worker_id)
                self._note_retry(request_id, retries, failure, len(emitted))

    async def _member_joined(self, role: Role, avoid: set[str], deadline: float) -> bool:
        """Wait until a member of `role` this request may use is registered (True), or the
        deadline (False). Only the view is looked at meanwhile: the attempt is not re-run, so
        nothing (a prefill choice, a prefix record) is counted for each look."""
        rank = rank_prefills if role is Role.PREFILL else rank_decodes
        inflight = self._inflight_prefill if role is Role.PREFILL else self._inflight_decode
        while time.monotonic() < deadline:
            if _excluding(rank(self.view.members.values(), inflight, self.revision), avoid):
                return True
            await asyncio.sleep(MEMBER_POLL_S)
        return False

    def _note_retry(self, request_id: str, retries: int, failure: _Retryable, emitted: int) -> None:
        """Log, trace and count one resume (the next attempt span carries `pdserve.retry`)."""
        log.warning(
            kv(
                event="request_retry",
                request=request_id,
                retry=retries,
                failed=failure.worker_id,
                emitted=emitted,
                error=str(failure.error),
            )
        )
        now = tracing.now_ns()
        attributes = {
            "pdserve.retry": retries,
            "pdserve.failed.member": failure.worker_id,
            "pdserve.resumed_tokens": emitted,
            "error.message": str(failure.error),
        }
        tracing.record("router.resume", now, now, attributes)
        if self._metrics is not None:
            self._metrics.observe_retry()

    async def _attempt(
        self,
        prompt_ids: list[int],
        emitted: list[int],
        params: SamplingParams,
        request_id: str,
        avoid: set[str],
        retries: int,
        seeds: list[int],
        cache_scope: str,
    ) -> AsyncIterator[TokenEvent]:
        """One road through a decode and a prefill; failures a retry may cure raise `_Retryable`.

        Everything that can fail without a worker (converting the parameters, choosing a
        prefill) happens before the Reserve; from the grant on, every way out (an error, a
        cancellation at any await, the client closing the stream) passes the `finally`, which
        either leaves the slot to a stream that finished or gives the grant back (`_give_back`).
        The loop stays here, not in a generator of `_Attempt`: closing this generator must run
        that `finally` at once, which a nested generator would leave to the garbage collector.
        """
        attempt = _Attempt(self, request_id, prompt_ids, emitted, params, avoid, retries, seeds, cache_scope)
        await attempt.reserve()
        # No await between these increments and the `try`: nothing can leave in between.
        self._inflight_decode[attempt.decode.worker_id] += 1
        self._inflight_prefill[attempt.prefill.worker_id] += 1
        try:
            attempt.launch()
            while True:
                event = await attempt.next_event()
                if event.HasField("handover"):  # the decode is draining: move the request, KV and all
                    await attempt.move(event.handover)
                    continue
                token = await attempt.token_event(event)
                yield token
                if attempt.finished:
                    return
        except BaseException as exc:
            mapped = attempt.failure(exc)
            if mapped is None:
                raise
            raise mapped from None
        finally:
            attempt.close()

    async def _next_event(
        self,
        call: Any,
        prefill_call: asyncio.Future[worker_pb2.PrefillReply],
        prefill_id: str,
        decode_id: str,
        lost: asyncio.Event,
    ) -> worker_pb2.TokenEvent:
        """The decode's next event; if the prefill fails first, its error (the decode would wait in
        vain); if the decode is found lost first, a retryable failure (its stream may never end)."""
        read = asyncio.ensure_future(call.read())
        lost_wait = asyncio.ensure_future(lost.wait())
        try:
            waiting = {read, lost_wait} | (set() if prefill_call.done() else {prefill_call})
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if not read.done() and lost.is_set():
                read.cancel()
                raise _Retryable(
                    decode_id, BackendUnavailable(f"decode {decode_id} left the membership and does not answer")
                )
            if prefill_call.done() and not read.done() and (prefill_call.cancelled() or prefill_call.exception()):
                read.cancel()
                await self._prefill_reply(prefill_call, prefill_id)  # raises the mapped error
        finally:
            lost_wait.cancel()
        event = await read
        if event is grpc.aio.EOF:
            raise _Retryable(decode_id, BackendError(f"decode {decode_id} ended the stream without a finish reason"))
        return cast(worker_pb2.TokenEvent, event)

    async def _prefill_reply(
        self, prefill_call: asyncio.Future[worker_pb2.PrefillReply], prefill_id: str
    ) -> worker_pb2.PrefillReply:
        try:
            return await prefill_call
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not prefill_call.cancelled() or (task is not None and task.cancelling()):
                raise  # this request itself is being cancelled (the client left)
            # gRPC ends a call whose channel we closed (its member left the membership) as
            # cancelled, not as an RpcError: that prefill is gone, another can take the prompt.
            raise _Retryable(
                prefill_id, BackendUnavailable(f"prefill {prefill_id} went away mid-call (its channel was closed)")
            ) from None
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if self._metrics is not None:
                self._metrics.observe_prefill_failure(code.name)
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise _Retryable(
                    prefill_id, RequestTimeout(f"prefill {prefill_id} did not finish in {self._t.prefill_s:g}s")
                ) from None
            if code == grpc.StatusCode.UNAVAILABLE:
                raise _Retryable(
                    prefill_id, BackendUnavailable(f"prefill {prefill_id} failed: {exc.details()}")
                ) from None
            if code == grpc.StatusCode.INVALID_ARGUMENT:  # the request's own input (its grammar): a 400, not retried
                raise InvalidPrompt(
                    exc.details() or "the request was refused", public=True
                ) from None  # (names no worker: the client reads it)
            raise BackendError(f"prefill {prefill_id} failed: {code.name}: {exc.details()}") from None

    # ---- choosing members ----------------------------------------------------------------------------

    @property
    def shares_prompt_prefill(self) -> bool:
        """Whether n copies of a prompt gain from following the first (api/prompt_copies.py):
        prefix routing is on and some prefill reports a prefix cache (or, routing by prediction
        alone, is assumed to have one)."""
        if self._prefixes is None:
            return False
        return self._reported is None or self._reported.any_enabled()

    def _pick_prefill(self, avoid: set[str], tokens: list[int], cache_scope: str) -> Member:
        """The prefill predicted to hold the longest prefix of `tokens` within the balance bound
        (router/prefix_routing.py), else the shortest queue; remembered as holding it now."""
        members = rank_prefills(self.view.members.values(), self._inflight_prefill, self.revision)
        ranked = _excluding(members, avoid)
        if not ranked:
            raise _none_left(Role.PREFILL, self.revision, members, self._departures.recent(Role.PREFILL))
        if self._prefixes is None:
            return ranked[0]
        by_id = {m.worker_id: m for m in ranked}
        ids = list(by_id)
        hashes = block_hashes(tokens, self._prefix_block_tokens, scoped_salt(self._prefix_salt, cache_scope))
        queues = {m.worker_id: estimated_queue(m, self._inflight_prefill[m.worker_id]) for m in ranked}
        bt = self._prefix_block_tokens
        matches = {w: blocks * bt for w, blocks in self._prefixes.matches(ids, hashes).items()}  # in tokens
        if self._reported is not None:
            matches.update(self._reported.matched_tokens(ids, tokens, cache_scope))  # reports win
        choice = choose_prefill(ids, queues, matches, self._recent.counts(), self._balance)
        followed = prompt_copies.preferred_prefill()  # a later copy of a prompt: where the first one ran
        if followed in by_id:
            choice = PrefillChoice(followed, matches.get(followed, 0) // bt, "copy")
        prompt_copies.note_prefill(choice.worker_id)
        self._prefixes.record(choice.worker_id, hashes)
        self._recent.record(choice.worker_id)
        if self._metrics is not None:
            self._metrics.observe_prefill_choice(choice.reason)
        return by_id[choice.worker_id]

    async def reserve_decode(
        self, request_id: str, num_prompt_tokens: int, max_tokens: int, avoid: set[str]
    ) -> tuple[Member, worker_pb2.Grant]:
        members = rank_decodes(self.view.members.values(), self._inflight_decode, self.revision)
        ranked = _excluding(members, avoid)
        if not ranked:
            raise _none_left(Role.DECODE, self.revision, members, self._departures.recent(Role.DECODE))
        request = worker_pb2.ReserveRequest(
            request_id=request_id,
            num_prompt_tokens=num_prompt_tokens,
            max_tokens=max_tokens,
            lease_ms=self._t.lease_ms,
            keep_for_copies=prompt_copies.later_copies(),
        )
        ranked, sharing = _sharing_first(ranked, request)
        full, failed = 0, []
        for member in ranked:
            stub = worker_pb2_grpc.DecodeStub(self.channel(member))
            asked = sharing if sharing is not None and member is ranked[0] else request
            reserve = asyncio.ensure_future(stub.Reserve(asked, timeout=self._t.rpc_s))
            try:
                # Shielded: cancelled while the Reserve is in flight (the client left), the call
                # goes on, and a grant that arrives anyway is given back instead of lost.
                grant = await asyncio.shield(reserve)
                capacity_held()  # the admission queue may let the next request try
                return member, grant
            except asyncio.CancelledError:
                self.spawn(self._give_back_late(member, reserve, request_id))
                raise
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise InvalidPrompt(f"decode {member.worker_id}: {exc.details()}") from None
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    full += 1
                else:
                    failed.append(f"{member.worker_id}: {code.name} {exc.details()}")
                    log.warning(
                        kv(event="reserve_failed", decode=member.worker_id, code=code.name, detail=exc.details())
                    )
        if full:
            raise NoCapacity(NO_CAPACITY_RETRY_S, f"no free KV slot on {full} decode worker(s)")
        raise BackendUnavailable(f"no decode worker could reserve a slot: {'; '.join(failed)}")

    # ---- giving grants back -------------------------------------------------------------------------

    async def _give_back_late(self, decode: Member, reserve: asyncio.Future[worker_pb2.Grant], request_id: str) -> None:
        """A Reserve whose request was cancelled while it was in flight: give back what it granted."""
        await asyncio.wait({reserve})  # (`wait`: the call's own failure or cancellation does not raise here)
        if reserve.cancelled() or reserve.exception() is not None:
            return  # nothing was granted
        await self._give_back(decode, reserve.result(), request_id, None, None)

    async def _give_back(
        self,
        decode: Member,
        grant: worker_pb2.Grant,
        request_id: str,
        prefill: Member | None,
        prefill_call: asyncio.Future[worker_pb2.PrefillReply] | None,
    ) -> None:
        """Return a grant the request will not finish with, counted by how it went back.

        Free at once (`push_settled`) where no write into the slot can still arrive: no Prefill
        was sent, or the prefill answered that its push is over (after a Cancel, if it was still
        running). Otherwise the decode quarantines the slot; if even the Release fails, the
        decode's lease takes the slot back on its own.
        """
        settled = prefill_call is None or await self._settle_push(prefill, prefill_call, grant, request_id)
        released = await self.release_decode(decode, grant, settled)
        if released is None:
            outcome = "lease"
        elif not released:
            outcome = "stream"  # nothing left to give back: the decode's stream had the slot
        else:
            outcome = "released" if settled else "quarantined"
        log.debug(
            kv(
                event="grant_returned",
                request=request_id,
                decode=decode.worker_id,
                slot=grant.slot,
                generation=grant.generation,
                outcome=outcome,
            )
        )
        if self._metrics is not None:
            self._metrics.observe_grant_returned(outcome)

    async def _settle_push(
        self,
        prefill: Member | None,
        prefill_call: asyncio.Future[worker_pb2.PrefillReply],
        grant: worker_pb2.Grant,
        request_id: str,
    ) -> bool:
        """Whether the prefill's push into `grant` is over: asks a prefill still at work to stop
        and waits (at most `settle_s`) for its answer. False when that cannot be known."""
        if not prefill_call.done() and prefill is not None:
            try:
                await worker_pb2_grpc.PrefillStub(self.channel(prefill)).Cancel(
                    worker_pb2.CancelPrefillRequest(
                        request_id=request_id, slot=grant.slot, generation=grant.generation
                    ),
                    timeout=self._t.rpc_s,
                )
            except grpc.aio.AioRpcError as exc:
                log.warning(
                    kv(
                        event="prefill_cancel_failed",
                        prefill=prefill.worker_id,
                        request=request_id,
                        code=exc.code().name,
                    )
                )
            done, _ = await asyncio.wait({prefill_call}, timeout=self._t.settle_s)
            if not done:
                prefill_call.cancel()
                return False
        if prefill_call.cancelled():
            return False
        error = prefill_call.exception()
        return error is None or (isinstance(error, grpc.aio.AioRpcError) and (push_settled(error) or never_sent(error)))

    async def release_decode(self, decode: Member, grant: worker_pb2.Grant, push_settled: bool) -> bool | None:
        """worker.proto's Release; None when it could not be delivered (the lease then lapses)."""
        stub = worker_pb2_grpc.DecodeStub(self.channel(decode))
        try:
            reply = await stub.Release(
                worker_pb2.ReleaseRequest(
                    request_id=grant.request_id, slot=grant.slot, generation=grant.generation, push_settled=push_settled
                ),
                timeout=self._t.rpc_s,
            )
        except grpc.aio.AioRpcError as exc:  # the lease lapses on its own: logged, not fatal
            log.warning(kv(event="release_failed", decode=decode.worker_id, slot=grant.slot, code=exc.code().name))
            return None
        return bool(reply.released)

    def channel(self, member: Member) -> grpc.aio.Channel:
        return self._channels.get(member.info.grpc_endpoint)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


class _Attempt:
    """The state of one `PDBackend._attempt`: the prefill and decode it holds, the grant, the two
    calls, what the client has been told, and the span; each step of the road is one method."""

    def __init__(
        self,
        backend: PDBackend,
        request_id: str,
        prompt_ids: list[int],
        emitted: list[int],
        params: SamplingParams,
        avoid: set[str],
        retries: int,
        seeds: list[int],
        cache_scope: str,
    ) -> None:
        self.backend = backend
        self.request_id, self.prompt_ids, self.emitted, self.params = request_id, prompt_ids, emitted, params
        self.avoid, self.retries, self.seeds, self.cache_scope = avoid, retries, seeds, cache_scope
        self.tokens = prompt_ids + emitted
        self.sampling = sampling_to_proto(params)  # max_tokens counts the emitted tokens too (worker.proto)
        self.prefill = backend._pick_prefill(avoid, self.tokens, cache_scope)
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
                "pdserve.request_id": request_id,
                "pdserve.retry": retries,
                "pdserve.prefill.member": self.prefill.worker_id,
                "pdserve.resumed_tokens": len(emitted) or None,
            },
        )

    async def reserve(self) -> None:
        """KV on a decode; a failure here ends the span (no grant is held yet)."""
        try:
            with tracing.use(self.span), tracing.span("router.reserve") as reserving:
                self.decode, self.grant = await self.backend.reserve_decode(
                    self.request_id, len(self.tokens), self.params.max_tokens - len(self.emitted), self.avoid
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

    def launch(self) -> None:
        """Open the decode's Generate stream, then send the prompt to the prefill."""
        decode_stub = worker_pb2_grpc.DecodeStub(self.backend.channel(self.decode))
        prefill_stub = worker_pb2_grpc.PrefillStub(self.backend.channel(self.prefill))
        with tracing.use(self.span):  # both calls carry the attempt's traceparent (pdserve_common/channels.py)
            self.call = decode_stub.Generate(
                worker_pb2.GenerateRequest(
                    request_id=self.request_id,
                    slot=self.grant.slot,
                    generation=self.grant.generation,
                    prompt_token_ids=self.tokens,
                    sampling=self.sampling,
                    readiness_timeout_ms=self.backend._t.readiness_ms,
                    num_generated=len(self.emitted),
                )
            )
            self.prefill_call = asyncio.ensure_future(
                prefill_stub.Prefill(
                    worker_pb2.PrefillRequest(
                        request_id=self.request_id,
                        prompt_token_ids=self.tokens,
                        sampling=self.sampling,
                        targets=push_targets(self.grant),
                        num_generated=len(self.emitted),
                        cache_scope=self.cache_scope,
                    ),
                    timeout=self.backend._t.prefill_s,
                )
            )
        self.lost = self.backend._lost.setdefault(self.decode.worker_id, asyncio.Event())

    async def next_event(self) -> worker_pb2.TokenEvent:
        assert self.prefill_call is not None
        return await self.backend._next_event(
            self.call, self.prefill_call, self.prefill.worker_id, self.decode.worker_id, self.lost
        )

    async def move(self, handover: worker_pb2.Handover) -> None:
        """The decode is draining: move the request to another decode (router/migration.py)."""
        backend = self.backend
        self.seeds.append(handover.seed)
        if self.params.seed is None:
            self.params = self.params.model_copy(update={"seed": handover.seed})
        source = self.decode
        try:
            # In the attempt's trace; the calls carry its traceparent (rpc/channels.py).
            with (
                tracing.use(self.span),
                tracing.span(
                    "router.migrate",
                    {"pdserve.source.member": source.worker_id, "pdserve.resumed_tokens": len(self.emitted)},
                ) as moving,
            ):
                moved = await migrate(
                    backend,
                    self.request_id,
                    self.prompt_ids,
                    self.emitted,
                    self.params,
                    source,
                    self.grant,
                    handover,
                    self.avoid,
                )
                moving.set_attributes(
                    {"pdserve.decode.member": moved.decode.worker_id, "pdserve.kv_bytes": moved.kv_bytes}
                )
        except MigrationFailed as exc:
            note(backend._metrics, self.request_id, source.worker_id, None, exc)
            raise _Retryable(source.worker_id, exc) from None
        note(backend._metrics, self.request_id, source.worker_id, moved)
        self.call.cancel()  # the source's stream is over; its KV was freed by the Migrate
        backend._inflight_decode[source.worker_id] -= 1
        backend._inflight_decode[moved.decode.worker_id] += 1
        self.decode, self.grant, self.call = moved.decode, moved.grant, moved.call
        self.lost = backend._lost.setdefault(self.decode.worker_id, asyncio.Event())
        self.migrations += 1
        self.info = None  # the next event reports the new decode

    async def token_event(self, event: worker_pb2.TokenEvent) -> TokenEvent:
        """The client's event for the decode's; an abort is retryable. Sets `finished` before the
        caller yields: the router closes the generator as soon as it has the last event, and a
        finished request must not be cancelled or released."""
        try:
            reason = finish_reason_from_proto(event.finish_reason)
        except ValueError:
            reason = FinishReason.ABORT  # a newer decode's reason: not an answer we can give
        if reason is FinishReason.ABORT:
            raise _Retryable(
                self.decode.worker_id, BackendError(f"decode {self.decode.worker_id} aborted request {self.request_id}")
            )
        logprobs = None
        if event.HasField("logprobs"):
            try:
                logprobs = logprobs_from_proto(event.logprobs)
            except ValueError as exc:
                raise _Retryable(
                    self.decode.worker_id, BackendError(f"decode {self.decode.worker_id}: {exc}")
                ) from None
        attach = await self._request_info(event, reason)
        self.finished = reason is not None
        return TokenEvent(event.token_id, event.text, reason, attach, logprobs, await self._prompt_logprobs())

    async def _prompt_logprobs(self) -> tuple[TokenLogprobs, ...] | None:
        """The prompt's logprobs, from the prefill's reply, for the request's first event only."""
        if self.params.prompt_logprobs is None or self.emitted or self.prompt_logprobs_sent:
            return None
        assert self.prefill_call is not None
        reply = await self.backend._prefill_reply(self.prefill_call, self.prefill.worker_id)
        self.prompt_logprobs_sent = True
        try:
            return tuple(logprobs_from_proto(entry) for entry in reply.prompt_logprobs)
        except ValueError as exc:
            raise BackendError(f"prefill {self.prefill.worker_id}: prompt {exc}") from None

    async def _request_info(self, event: worker_pb2.TokenEvent, reason: FinishReason | None) -> RequestInfo | None:
        """Which workers served the request and what the KV cost: attached to one event."""
        assert self.prefill_call is not None
        if self.info is not None:
            return None
        ids = (self.prefill.worker_id, self.decode.worker_id, self.retries)
        if self.migrations:  # the first event of the decode the request moved to
            self.info = RequestInfo(True, event.kv_bytes_received, None, *ids, migrations=self.migrations)
            return self.info
        if self.prefill_call.done() or reason is not None:
            # The prefill's reply has the push's figures; at the latest the last token waits for it.
            reply = await self.backend._prefill_reply(self.prefill_call, self.prefill.worker_id)
            self.info = RequestInfo(True, reply.kv_bytes, reply.push_seconds, *ids, reply.cached_tokens)
            return self.info
        if event.index == len(self.emitted):
            return RequestInfo(event.kv_pushed, event.kv_bytes_received, None, *ids)
        return None

    def failure(self, exc: BaseException) -> BaseException | None:
        """What to raise for `exc` (None: re-raise it as it is)."""
        if not self.finished:
            self.span.record_exception(exc)
        if not isinstance(exc, grpc.aio.AioRpcError):
            return None
        error = _decode_error(exc, self.decode.worker_id, self.request_id)
        if exc.code() in _RETRYABLE_DECODE:
            # The decode's readiness wait timing out means the prefill never delivered; an
            # ABORTED Generate, that what it delivered cannot be used (a bad or partial push).
            at_prefill = exc.code() in _PREFILL_AT_FAULT and not self.migrations  # a migrated KV came from no prefill
            culprit = self.prefill.worker_id if at_prefill else self.decode.worker_id
            return _Retryable(culprit, error)
        return error

    def close(self) -> None:
        """Every way out: end the span, count the workers free, give back an unfinished grant."""
        backend = self.backend
        self.span.set_attribute("pdserve.finished", self.finished)
        self.span.end()
        backend._inflight_decode[self.decode.worker_id] -= 1
        backend._inflight_prefill[self.prefill.worker_id] -= 1
        if not self.finished:
            if self.call is not None:
                self.call.cancel()  # a committed slot is freed by the decode once its request leaves the batch
            backend.spawn(backend._give_back(self.decode, self.grant, self.request_id, self.prefill, self.prefill_call))


class _Retryable(Exception):
    """A failure of one worker that another may not have: `error` is raised if no retry is left."""

    def __init__(self, worker_id: str, error: BackendError) -> None:
        super().__init__(str(error))
        self.worker_id = worker_id
        self.error = error


# UNAVAILABLE: the decode went away (killed, network) or a member of its group did; INTERNAL:
# its generation loop failed; DEADLINE_EXCEEDED: its readiness wait ended without the prefill's
# notification; ABORTED: the notification that came cannot be used (malformed, for another
# prompt length, a group's members disagree).
_RETRYABLE_DECODE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED}
)
_PREFILL_AT_FAULT = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED})


def _none_left(role: Role, revision: str, members: list[Member], departed: bool) -> BackendUnavailable:
    """No member this request may use. Worth waiting for (NoMember) when none is registered at
    all, or one of the role left lately (restarting, or the view refilling after a broker
    restart); not when the registered ones are all the deployment has and each failed this
    request already: waiting would only delay its error."""
    if not members:
        return NoMember(f"no {role} worker of model revision {revision} is registered", role)
    failed = ", ".join(m.worker_id for m in members)
    text = f"no {role} worker of model revision {revision} is registered but the failed {failed}"
    return NoMember(text, role) if departed else BackendUnavailable(text)


def _sharing_first(
    ranked: list[Member], request: worker_pb2.ReserveRequest
) -> tuple[list[Member], worker_pb2.ReserveRequest | None]:
    """A later copy of a prompt (api/prompt_copies.py): the decode holding the first copy's KV
    first, asked to share its prompt blocks (push once); any other decode gets the plain
    request. Unchanged when there is no first copy to share with, or its decode is not a choice."""
    shared = prompt_copies.shared_decode()
    first = None if shared is None else next((m for m in ranked if m.worker_id == shared[0]), None)
    if shared is None or first is None:
        return ranked, None
    sharing = worker_pb2.ReserveRequest()
    sharing.CopyFrom(request)
    sharing.share_from.slot, sharing.share_from.generation = shared[1], shared[2]
    return [first, *(m for m in ranked if m is not first)], sharing


def _excluding(ranked: list[Member], avoid: set[str]) -> list[Member]:
    """Members that have not failed this request. A failed one is not tried again: a stalled
    worker would stall the retry too and cost another quarantined slot, and a dead one stays
    in the membership until its lease lapses."""
    return [m for m in ranked if m.worker_id not in avoid]


def _decode_error(exc: grpc.aio.AioRpcError, decode_id: str, request_id: str) -> BackendError:
    code, details = exc.code(), exc.details()
    where = f"decode {decode_id} (request {request_id})"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return RequestTimeout(f"{where}: {details}")
    if code == grpc.StatusCode.UNAVAILABLE:
        return BackendUnavailable(f"{where} is unavailable: {details}")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidPrompt(f"{where}: {details}")
    return BackendError(f"{where}: {code.name}: {details}")
