"""Placement and members: the router's view of its prefills and decodes, and the choice among them.

`Members` watches the broker's membership (what joined, left, is lost), counts this router's
requests on each worker, follows the prefills' block events (router/kv_index.py) and holds the
channels to them. It ranks decodes (`ranked`, router/placement.py) and chooses the prefill for
a prompt (`pick_prefill`, router/prefix_routing.py). A request that finds no member it may use
gets `NoMember` when waiting is worth it (`none_left`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve_common.channels import aio_channel
from pdserve_common.logs import kv
from pdserve_common.membership import EventType, Member, MemberEvent, Role
from pdserve_worker.api import prompt_copies
from pdserve_worker.api.backend import BackendUnavailable
from pdserve_worker.api.metrics import RouterMetrics
from pdserve_worker.kv.block_events import MAX_EVENTS_PER_REPLY
from pdserve_worker.kv.prefix_cache import block_hashes, cache_salt, scoped_salt
from pdserve_worker.router.config import RouterConfig
from pdserve_worker.router.departures import Departures
from pdserve_worker.router.disaggregation import Disaggregation
from pdserve_worker.router.kv_index import ReportedIndex
from pdserve_worker.router.placement import compatible, estimated_queue, prefer_cached, rank_decodes, rank_prefills
from pdserve_worker.router.prefix_routing import PrefillChoice, PrefixHistory, RecentShare, choose_prefill
from pdserve_worker.rpc.broker_client import BrokerClient
from pdserve_worker.rpc.broker_watch import MembershipView
from pdserve_worker.rpc.channel_pool import ChannelPool

log = logging.getLogger(__name__)

CLOSE_WAIT_S = 2.0
BLOCK_EVENTS_POLL_S = 0.25  # how often a router pulls each prefill's block events (router/kv_index.py)
BLOCK_EVENTS_PAGES = 8  # replies taken from one prefill per round (a backlog takes several rounds)
MEMBER_POLL_S = 0.1  # how often a request waiting for a member looks at the membership again


class NoMember(BackendUnavailable):
    """No prefill (decode) that this request may use is registered right now. `departed`: one
    of the role left lately (restarting, most likely); `worth_waiting`: one may join soon (that,
    or none is registered at all: `none_left`)."""

    def __init__(self, message: str, role: Role, worth_waiting: bool = True, departed: bool = False) -> None:
        super().__init__(message)
        self.role = role
        self.worth_waiting = worth_waiting or departed
        self.departed = departed


@dataclass(frozen=True)
class PrefillPick:
    """A prefill chosen for a prompt, the prompt's tokens it is predicted to hold, and what
    records the choice (prefix history, balance share, the prompt's copies): called once the
    prompt is sent there, not when the decode computes it (router/disaggregation.py)."""

    member: Member
    cached_tokens: int
    note: Callable[[], None]


class Members:
    """The membership as this router uses it: who serves, how busy, what each prefill holds."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics | None) -> None:
        self.config = config
        self.metrics = metrics
        self.revision = config.revision
        self._view: MembershipView | None = None
        self._channels = ChannelPool(config.token, config.tls, self.spawn, grace_s=config.timeouts.prefill_s)
        self.inflight_decode: Counter[str] = Counter()
        self.inflight_prefill: Counter[str] = Counter()
        self._departures = Departures()  # who left lately: worth waiting for when none is left
        self._instances: dict[str, int] = {}  # worker id -> registered_unix_ms of the instance last seen
        self._background: set[asyncio.Task[None]] = set()
        # Set when a decode is found lost (left the membership and does not answer): its streams end.
        self.lost: dict[str, asyncio.Event] = {}
        # Prefix-aware prefill choice from this router's own routing history (0 blocks: off).
        blocks = config.prefix_history_blocks
        self.prefixes = PrefixHistory(blocks) if blocks else None
        self._recent = RecentShare()
        # Only this router's own predictions use these hashes: the revision keeps two models apart.
        self._prefix_salt = cache_salt(config.revision, "router-prediction", config.prefix_block_tokens)
        events = config.prefix_routing == "events" and self.prefixes is not None
        self._reported = ReportedIndex() if events else None
        # What each decode's prefix cache holds (kv/decode_prefix.py), from its own reports.
        self._decode_held = ReportedIndex()
        self._follower: asyncio.Task[None] | None = None
        self.disaggregation = Disaggregation(config.disaggregation)  # remote or local prefill, per request

    # ---- lifecycle -----------------------------------------------------------------------------

    async def watch(self, broker: BrokerClient) -> None:
        """Watch the decode and prefill membership (inside the event loop that serves requests)."""
        self._view = await broker.watch([Role.DECODE, Role.PREFILL], listener=self.on_member)
        self._follower = asyncio.get_running_loop().create_task(self._follow_block_events())

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

    @property
    def connected(self) -> bool:
        return self._view is not None and self._view.connected

    def ready(self) -> dict[str, int]:
        """Members that could serve a request now, by role."""
        members = self.view.members.values() if self._view is not None else ()
        return {
            role.value: sum(1 for m in members if compatible(m, role, self.revision))
            for role in (Role.PREFILL, Role.DECODE)
        }

    def in_flight(self) -> dict[str, int]:
        """Requests this router has on decodes and on prefills now (0 once they are all over)."""
        return {"decode": sum(self.inflight_decode.values()), "prefill": sum(self.inflight_prefill.values())}

    def channel(self, member: Member) -> grpc.aio.Channel:
        return self._channels.get(member.info.grpc_endpoint)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- following the membership ----------------------------------------------------------------

    def on_member(self, event: MemberEvent) -> None:
        member = event.member
        if member is None:
            return
        if event.type is EventType.ADDED:
            self._departures.joined(member.role, member.worker_id)
        if event.type is EventType.REMOVED:
            self._instances.pop(member.worker_id, None)
            self._left(member)
            return
        self._new_instance(member)
        if member.role is Role.DECODE and self.metrics is not None:
            used = member.load.slots_used
            self.metrics.set_decode_slots(
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

    def _new_instance(self, member: Member) -> None:
        """A worker registered anew (restarted, its live registration replaced; or the same
        process again after a broker restart): the channel to a dead process may be in gRPC's
        reconnect backoff, where every call fails at once, so later calls get a fresh channel;
        calls still on the old one keep their grace (a broker restart leaves them alone)."""
        before = self._instances.get(member.worker_id)
        self._instances[member.worker_id] = member.registered_unix_ms
        if before is not None and before != member.registered_unix_ms:
            log.info(kv(event="member_restarted", worker=member.worker_id, role=member.role))
            self._channels.forget(member.info.grpc_endpoint)

    def _left(self, member: Member) -> None:
        self._departures.left(member.role, member.worker_id)
        if member.role is Role.PREFILL and self.prefixes is not None:
            self.prefixes.forget(member.worker_id)  # a prefill that comes back holds nothing
        if member.role is Role.PREFILL and self._reported is not None:
            self._reported.forget(member.worker_id)
        if member.role is Role.PREFILL:
            self.disaggregation.forget(member.worker_id)
        if member.role is Role.DECODE:
            self._decode_held.forget(member.worker_id)
        if member.role is Role.DECODE and self.metrics is not None:
            self.metrics.forget_decode(member.worker_id)
        if member.role is Role.DECODE and self.inflight_decode[member.worker_id] > 0:
            # Closing its channel now would cancel our streams there: the probe decides.
            self.spawn(self._probe_decode(member))
            return
        self._channels.forget(member.info.grpc_endpoint)

    async def _probe_decode(self, member: Member) -> None:
        """A decode with our streams left the membership: if it does not answer either (frozen,
        or gone without closing its connections), its streams are given up and resumed
        elsewhere. One that answers keeps them: the broker may merely have restarted."""
        channel = aio_channel(member.info.grpc_endpoint, self.config.token, self.config.tls)
        try:
            await worker_pb2_grpc.DecodeStub(channel).Status(
                worker_pb2.StatusRequest(), timeout=self.config.timeouts.rpc_s
            )
        except grpc.aio.AioRpcError as exc:
            log.warning(
                kv(
                    event="decode_lost",
                    decode=member.worker_id,
                    code=exc.code().name,
                    streams=self.inflight_decode[member.worker_id],
                )
            )
            self.lost.pop(member.worker_id, asyncio.Event()).set()
            await asyncio.sleep(0)  # the streams give up (and cancel their calls) before the channel closes
            self._channels.forget(member.info.grpc_endpoint)
        finally:
            await channel.close()

    async def _follow_block_events(self) -> None:
        """Pull every prefill's (with prefix routing by events) and every decode's block events
        into their index, BLOCK_EVENTS_POLL_S apart."""
        while True:  # all at once: one slow member does not hold back the others' events
            members = [m for m in self.view.members.values() if self._index_of(m) is not None]
            await asyncio.gather(*(self._follow(m) for m in members))
            await asyncio.sleep(BLOCK_EVENTS_POLL_S)

    async def _follow(self, member: Member) -> None:
        index = self._index_of(member)
        try:
            await self._pull_block_events(member)
        except Exception as exc:  # noqa: BLE001 - one bad reply must not stop following the others
            log.warning(kv(event="block_events_apply_failed", member=member.worker_id, error=repr(exc)))
            if index is not None:
                index.forget(member.worker_id)  # unknown again: the prediction stands in

    def _index_of(self, member: Member) -> ReportedIndex | None:
        return self._decode_held if member.role is Role.DECODE else self._reported

    async def _pull_block_events(self, member: Member) -> None:
        index = self._index_of(member)
        assert index is not None
        channel = self.channel(member)
        stub = (
            worker_pb2_grpc.DecodeStub(channel) if member.role is Role.DECODE else worker_pb2_grpc.PrefillStub(channel)
        )
        for _ in range(BLOCK_EVENTS_PAGES):  # a long backlog comes in pages; the rest next round
            epoch, after = index.cursor(member.worker_id)
            try:
                reply = await stub.BlockEvents(
                    worker_pb2.BlockEventsRequest(epoch=epoch, after_seq=after), timeout=self.config.timeouts.rpc_s
                )
            except grpc.aio.AioRpcError as exc:
                log.debug(kv(event="block_events_failed", member=member.worker_id, code=exc.code().name))
                return
            if member.worker_id not in self.view.members:
                return  # it left meanwhile: its entry was forgotten (a restart comes with a new epoch)
            index.apply(member.worker_id, reply)
            if reply.reset or sum(len(r.block_hashes) for r in reply.runs) < MAX_EVENTS_PER_REPLY:
                return

    # ---- choosing members ----------------------------------------------------------------------------

    @property
    def shares_prompt_prefill(self) -> bool:
        """Whether n copies of a prompt gain from following the first (api/prompt_copies.py):
        prefix routing is on and some prefill reports a prefix cache (or, routing by prediction
        alone, is assumed to have one)."""
        if self.prefixes is None:
            return False
        return self._reported is None or self._reported.any_enabled()

    def ranked(self, role: Role, avoid: Mapping[str, int]) -> list[Member]:
        """The members of `role` this request may use, best first; raises when there is none."""
        rank = rank_prefills if role is Role.PREFILL else rank_decodes
        inflight = self.inflight_prefill if role is Role.PREFILL else self.inflight_decode
        members = rank(self.view.members.values(), inflight, self.revision)
        ranked = excluding(members, avoid)
        if not ranked:
            raise none_left(role, self.revision, members, self._departures.recent(role))
        return ranked

    def ranked_decodes_for(self, avoid: Mapping[str, int], tokens: list[int], cache_scope: str) -> list[Member]:
        """The decodes for `tokens`, best first: the one whose prefix cache holds the longest
        prefix of them (its reports) first, within the balance bound (placement.prefer_cached)."""
        ranked = self.ranked(Role.DECODE, avoid)
        cached = self._decode_held.matched_tokens([m.worker_id for m in ranked], tokens, cache_scope)
        return prefer_cached(ranked, cached, self.inflight_decode, self.config.balance)

    def note_decode_kept(self, decode_id: str, tokens: list[int], cache_scope: str) -> None:
        """A request ended on `decode_id`, whose prefix cache now keeps `tokens`' blocks: taken
        as held until its events say otherwise (the next turn may come before they do)."""
        self._decode_held.predict(decode_id, tokens, cache_scope)

    def pick_prefill(self, avoid: Mapping[str, int], tokens: list[int], cache_scope: str) -> Member:
        pick = self.pick_prefill_for(avoid, tokens, cache_scope)
        pick.note()
        return pick.member

    def pick_prefill_for(self, avoid: Mapping[str, int], tokens: list[int], cache_scope: str) -> PrefillPick:
        """The prefill predicted to hold the longest prefix of `tokens` within the balance bound
        (router/prefix_routing.py), else the shortest queue, and the tokens it is predicted to
        hold; `note()` remembers it as holding them (only if the prompt goes there)."""
        ranked = self.ranked(Role.PREFILL, avoid)
        if self.prefixes is None:
            return PrefillPick(ranked[0], 0, lambda: None)
        prefixes = self.prefixes
        by_id = {m.worker_id: m for m in ranked}
        ids = list(by_id)
        bt = self.config.prefix_block_tokens
        hashes = block_hashes(tokens, bt, scoped_salt(self._prefix_salt, cache_scope))
        queues = {m.worker_id: estimated_queue(m, self.inflight_prefill[m.worker_id]) for m in ranked}
        matches = {w: blocks * bt for w, blocks in prefixes.matches(ids, hashes).items()}  # in tokens
        if self._reported is not None:
            matches.update(self._reported.matched_tokens(ids, tokens, cache_scope))  # reports win
        choice = choose_prefill(ids, queues, matches, self._recent.counts(), self.config.balance)
        followed = prompt_copies.preferred_prefill()  # a later copy of a prompt: where the first one ran
        if followed in by_id:
            choice = PrefillChoice(followed, matches.get(followed, 0) // bt, "copy")

        def note() -> None:
            prompt_copies.note_prefill(choice.worker_id)
            prefixes.record(choice.worker_id, hashes)
            self._recent.record(choice.worker_id)
            if self.metrics is not None:
                self.metrics.observe_prefill_choice(choice.reason)

        return PrefillPick(by_id[choice.worker_id], matches.get(choice.worker_id, 0), note)

    async def joined(self, role: Role, avoid: Mapping[str, int], deadline: float) -> bool:
        """Wait until a member of `role` this request may use is registered (True: a new one,
        or a failed one restarted), or the deadline (False). Only the view is looked at
        meanwhile: the attempt is not re-run, so nothing (a prefill choice, a prefix record) is
        counted for each look."""
        rank = rank_prefills if role is Role.PREFILL else rank_decodes
        inflight = self.inflight_prefill if role is Role.PREFILL else self.inflight_decode
        while time.monotonic() < deadline:
            if excluding(rank(self.view.members.values(), inflight, self.revision), avoid):
                return True
            await asyncio.sleep(MEMBER_POLL_S)
        return False


def none_left(role: Role, revision: str, members: list[Member], departed: bool) -> NoMember:
    """No member this request may use. Worth waiting for when none is registered at all, or one
    of the role left lately (restarting, or the view refilling after a broker restart); not
    when the registered ones are all the deployment has and each failed this request already:
    waiting would only delay its error, unless the failure was a worker going away. Where one
    went away, PDBackend waits for it to come back (`Timeouts.return_wait_s`)."""
    if not members:
        return NoMember(f"no {role} worker of model revision {revision} is registered", role, departed=departed)
    failed = ", ".join(m.worker_id for m in members)
    text = f"no {role} worker of model revision {revision} is registered but the failed {failed}"
    return NoMember(text, role, worth_waiting=False, departed=departed)


def excluding(ranked: list[Member], avoid: Mapping[str, int]) -> list[Member]:
    """Members that have not failed this request. A failed instance is not tried again: a
    stalled worker would stall the retry too and cost another quarantined slot, and a dead one
    stays in the membership until its lease lapses. The same worker registered anew (another
    `registered_unix_ms`: restarted) is another instance; 0 in `avoid` stands for any."""
    return [m for m in ranked if avoid.get(m.worker_id, -1) not in (0, m.registered_unix_ms)]
