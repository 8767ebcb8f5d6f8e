"""The decode role: a KV pool registered with the transfer engine, slots with leases, token streams.

The request road (worker.proto): the router `Reserve`s a slot here and gets a grant (where
the slot's bytes are); it opens `Generate` with that grant, which waits for the slot's ready
notification, which a prefill worker sends after pushing the prompt's KV into the slot and
which carries the first token; then the request joins the continuous batch of the
`GenerationLoop` and its tokens stream back as `TokenEvent`s.

The pool is paged by default (`kv_block_tokens` > 0, kv/blocks.py): a grant is a handle (its
`slot`), a generation and the blocks for prompt + max_tokens, and the request decodes through
its block table (kv/paged.py). Every name below — slot, generation, lease, quarantine — means
the same for both pools; a layer-sharded group keeps max-length slots.

Who frees a slot, however the stream ends:
- before the KV was committed (timeout, cancel, error): `SlotTable.release` quarantines it,
  because a prefill may still be writing into it;
- after commit: the generation loop calls back once the request left the batch (finished,
  cancelled or failed), and only then is the slot free for the next grant.

Stop strings and stop tokens are handled here, once (the engine's Generator does it): a
stream's text never contains a stop string and ends with FINISH_REASON_STOP, so the
generation ends, and the slot is freed, the moment it matched.

Draining (`drain()`, the pod's preStop `GET /drain`): no new grants (Reserve answers
UNAVAILABLE), the broker marks the member draining so routers look elsewhere, then requests
in flight are handed over (`drain_mode` migrate, the default: decode/migration.py; their KV is
pushed to another decode the router reserved and they go on there, no prefill involved), or
ended at once for the router to resume (resume), or run to the end (wait, and always for a
tensor-parallel decode), up to the drain timeout; then the caller deregisters.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import grpc
from pydantic import ValidationError

from pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve_common import tracing
from pdserve_common.kv_layout import DTYPE_SIZES, KVLayout
from pdserve_common.logs import kv
from pdserve_common.membership import Load, MemberInfo, MemoryRegion, MemType, Role
from pdserve_worker.decode.generation_loop import GenerationLoop, Parked, RequestFailed, RequestStream
from pdserve_worker.decode.migration import (
    MIGRATED,
    Handoff,
    HandoffBook,
    HandoffUnavailable,
    MigrationResult,
    push_handoff,
)
from pdserve_worker.engines.base import Engine
from pdserve_worker.engines.native import NativeEngine, native_of
from pdserve_worker.kv.blocks import BlockTable, BlockUsage
from pdserve_worker.kv.cache import KVCache
from pdserve_worker.kv.memory_budget import auto_kv_tokens, own_memory
from pdserve_worker.kv.paged import PagedKVCache
from pdserve_worker.kv.reservations import reservation_nonce
from pdserve_worker.kv.slots import Grant, NoFreeSlot, SlotTable, SlotUsage
from pdserve_worker.model.engine import Generator
from pdserve_worker.model.sampling.params import MAX_LOGPROBS, FinishReason, SamplingParams, TokenLogprobs
from pdserve_worker.model.sampling.sampler import stop_token_ids
from pdserve_worker.rpc.broker_client import BrokerClient
from pdserve_worker.rpc.convert import (
    finish_reason_to_proto,
    grant_to_proto,
    logprobs_to_proto,
    push_targets_from_proto,
    sampling_from_proto,
)
from pdserve_worker.rpc.trailers import settled_trailer
from pdserve_worker.serving.settings import WorkerSettings
from pdserve_worker.serving.worker_metrics import WorkerMetrics
from pdserve_worker.transfer.base import TransferBackend, TransferError
from pdserve_worker.transfer.leases import BlockWriteLeases, SlotWriteLeases
from pdserve_worker.transfer.pool import KVPool
from pdserve_worker.transfer.push import PushError, PushSource
from pdserve_worker.transfer.readiness import Readiness, ReadinessTimeout, SlotNotReserved

log = logging.getLogger("pdserve.decode")

SWEEP_S = 1.0  # how often lapsed leases are looked for


class ReadyUnusable(RuntimeError):
    """The ready notification(s) for a slot cannot be decoded from: malformed, for another
    prompt length, or a layer-sharded group's members disagree. The push is at fault, not this
    decode: Generate answers ABORTED, which the router retries with another prefill."""


class MemberUnavailable(RuntimeError):
    """A member of this decode's layer-sharded group did not answer: Generate answers
    UNAVAILABLE, and the router resumes the request on another decode."""


@dataclass(frozen=True)
class Ready:
    """What the ready notification told us about a slot's KV."""

    num_tokens: int
    first_token: int
    wait_s: float
    message: dict[str, Any] = field(default_factory=dict)  # the whole notify (a migration's state)
    first_logprobs: TokenLogprobs | None = None  # the first token's, drawn by the prefill
    kv_bytes: int = 0  # what was pushed for it (not the blocks shared with another copy)


class MemberPushes(Protocol):
    """The other members' pushes of one handed-over request (`GroupHooks.push_members`)."""

    def wait(self) -> int:
        """Their bytes, once every push landed; raises MemberUnavailable naming one that failed."""
        ...

    def settle(self) -> None:
        """Until none of them is still running (whatever their outcome)."""
        ...


class GroupHooks(Protocol):
    """What a layer-sharded group's leader does beyond a plain decode (`decode.shard.ShardGroup`):
    its pool holds member 0's layers, its decode step hops through the followers, its grants
    name every member, and its KV is ready once every member's notification arrived."""

    def pool_layout(self, full: KVLayout) -> KVLayout:
        """The leader's own pool, given the whole model's."""
        ...

    def generator(self, engine: NativeEngine, cache: KVCache) -> Generator[Any]: ...

    def grants(self, grant: Grant) -> list[Grant]:
        """Every member's grant of the leader's `grant` (the prefill's push targets)."""
        ...

    async def wait_ready(self, slot: int, generation: int, timeout_s: float) -> list[tuple[int, int]]:
        """Each follower's (num_tokens, first_token) for the slot, once its notification came."""
        ...

    def labels(self) -> dict[str, str]:
        """What the leader's broker registration says about its group."""
        ...

    def write_leases(self, own: Any) -> Any:
        """The write-lease hooks of the leader's table, given its own engine's (`own`)."""
        ...

    @property
    def migrates(self) -> bool:
        """Whether its requests can be handed over when draining (`push_members` works)."""
        ...

    def push_members(
        self,
        slot: int,
        generation: int,
        nonce: str,
        num_tokens: int,
        targets: Sequence[Grant],
        timeout_s: float,
        blocks: Sequence[int] = (),
    ) -> MemberPushes:
        """Start every other member's push of its share of reservation (slot, generation), whose
        KV is in `blocks` of a paged pool (members with pools of the same blocks need them)."""
        ...

    def close(self) -> None: ...


class DecodeWorker:
    """The state of one decode worker; the gRPC servicer and the HTTP endpoints call into it.

    `group`: set for a layer-sharded group's leader (the hooks of `GroupHooks`); a plain decode
    holds every layer."""

    def __init__(
        self,
        settings: WorkerSettings,
        engine: Engine,
        backend: TransferBackend,
        revision: str,
        group: GroupHooks | None = None,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.backend = backend
        self.revision = revision
        self.group = group
        full = engine.kv_layout(settings.slots, settings.max_length, settings.model_dtype)
        # Paged unless kv_block_tokens is 0; a layer-sharded group keeps max-length slots.
        layout = (
            paged_layout(full, settings.kv_block_tokens, settings.kv_tokens or pool_tokens(settings, full))
            if group is None
            else group.pool_layout(full)
        )
        self.layout = layout
        self.pool = KVPool(backend, layout, device=settings.device)
        # Quarantine outlives the prefill's transfer timeout: an abandoned push that is still
        # writing lands in a slot nobody has been granted since.
        quarantine_s = settings.transfer_timeout_ms / 1000 + 5.0
        # Only reserved slots are writable by peers (host engine), and a ready notify counts
        # only with its grant's nonce: neither a stray peer nor a forged notify can touch a
        # request that is not theirs.
        warm = self._own_the_pool(layout, quarantine_s)
        cache = self.cache
        self.readiness = Readiness(
            backend,
            settings.readiness_mode,
            accepts=self.slots.is_reserved,
            authorize=self.slots.verify,
            poll_interval_us=settings.poll_interval_micros,
            warmup=warm if settings.warmup else None,
        )
        generator = (
            Generator(engine, engine.tokenizer, cache) if group is None else group.generator(native_of(engine), cache)
        )
        self.loop = GenerationLoop(generator, name="decode-loop")
        # One blocking readiness wait per request that waits: at most one per slot.
        self._waiters = ThreadPoolExecutor(max_workers=layout.num_slots, thread_name_prefix="decode-ready")
        self.draining = False
        self._sweeper: asyncio.Task[None] | None = None
        self.metrics = WorkerMetrics("decode")  # served on /metrics (worker_main)
        self._watch()
        # Requests handed over while draining (decode/migration.py), and the one thread that pushes them.
        self.handoffs = HandoffBook()
        self._migrations = ThreadPoolExecutor(max_workers=1, thread_name_prefix="decode-migrate")

    def _own_the_pool(self, layout: KVLayout, quarantine_s: float) -> Any:
        """The pool's one grant owner, its write leases and the cache view over it: blocks for
        a paged pool, slots otherwise; returns the pool's warm-up."""
        settings, base_addr, paged = self.settings, self.pool.base_addr, layout.paged
        self.leases = (BlockWriteLeases if paged else SlotWriteLeases)(self.backend, base_addr, layout)
        if self.group is not None:
            self.leases = self.group.write_leases(self.leases)  # (a tensor-parallel decode's other ranks too)
        table = BlockTable if paged else SlotTable
        self.slots: SlotTable | BlockTable = table(
            layout,
            engine_id=settings.engine_id,
            base_addr=base_addr,
            quarantine_s=quarantine_s,
            capability_key=settings.capability_key(),
            leases=self.leases,
        )
        self.cache: KVCache | PagedKVCache = (PagedKVCache if paged else KVCache)(layout, self.pool.tensor)
        return self._warm_blocks if paged else self.pool.warm

    def _watch(self) -> None:
        num_slots = self.layout.num_slots
        self.metrics.watch_decode(
            lambda: num_slots - self.slot_usage().free,
            num_slots,
            lambda: self.loop.active,
            lambda: self.loop.stats,
            kv_tokens=self.kv_tokens,
        )

    # ---- what a paged pool adds to the request road (kv/blocks.py) --------------------------------

    def reserve(
        self,
        request_id: str,
        ttl_s: float,
        num_prompt_tokens: int,
        max_tokens: int,
        share_from: tuple[int, int] | None = None,
        keep_for: int = 0,
    ) -> Grant:
        """A grant for a request of `num_prompt_tokens` + `max_tokens`: a slot, or the blocks of
        exactly that many tokens (raises NoFreeSlot, or its NoFreeBlocks, when there is no room).
        `share_from`: another copy of the prompt decoding here, whose whole prompt blocks a paged
        pool shares read-only (as many as are still there; a slot pool has none to share);
        `keep_for`: the later copies of this one's prompt, which will ask to share it."""
        if isinstance(self.slots, BlockTable):
            return self.slots.reserve(
                request_id,
                ttl_s,
                num_tokens=num_prompt_tokens + max_tokens,
                prompt_tokens=num_prompt_tokens,
                share_from=share_from,
                shared_blocks=None,
                keep_for=min(keep_for, self.slots.max_reservations),
            )
        return self.slots.reserve(request_id, ttl_s)

    def shared_tokens(self, slot: int, generation: int) -> int:
        """Tokens of (slot, generation)'s prompt held in blocks shared with another copy (not pushed)."""
        grant = self.slots.grant_of(slot, generation) if isinstance(self.slots, BlockTable) else None
        return 0 if grant is None else grant.shared * self.layout.block_tokens

    def note_prompt(self, slot: int, generation: int, token_ids: list[int]) -> str | None:
        """The prompt of a reservation (kv/blocks.py `note_prompt`): why it cannot be, or None."""
        if isinstance(self.slots, BlockTable):
            return self.slots.note_prompt(slot, generation, token_ids)
        return None

    def adopt(self, slot: int, generation: int) -> None:
        """The KV of (slot, generation) is committed: decode reads it through its block table."""
        if isinstance(self.cache, PagedKVCache):
            self.cache.bind(slot, self.slots.blocks_of(slot))

    def finished(self, slot: int, generation: int) -> None:
        """The request left the batch: its blocks are nobody's to read, and the grant is freed."""
        if isinstance(self.cache, PagedKVCache):
            self.cache.unbind(slot)
        self.slots.release(slot, generation)

    def _warm_blocks(self, slot: int, num_tokens: int) -> None:
        blocks = self.slots.blocks_of(slot)
        bt = self.layout.block_tokens
        self.pool.warm_blocks(blocks[: -(-num_tokens // bt)])

    def group_grants(self, grant: Grant) -> list[Grant]:
        """Every member's grant of a layer-sharded group's slot; none for an unsharded decode."""
        return [] if self.group is None else self.group.grants(grant)

    @property
    def supports_migration(self) -> bool:
        """Whether this decode can hand its requests over when draining (every kind can now: a
        group's members and a tensor-parallel decode's ranks push their shares)."""
        return self.group is None or self.group.migrates

    def push_handoff(self, handoff: Handoff, targets: list[Grant]) -> MigrationResult:
        """Push a handed-over request's KV from this pool into `targets` (blocking). A layer-
        sharded group's followers push their layers meanwhile; the notify waits for them, and
        however this ends, no follower is still reading its pool when it returns."""
        # (a tensor-parallel rank 0 pushes only its heads; the other ranks push theirs)
        source = PushSource(self.pool.base_addr, self.layout, handoff.slot, heads=self.layout.head_range)
        blocks = self.slots.blocks_of(handoff.slot) if isinstance(self.slots, BlockTable) else ()
        timeout_s = self.settings.transfer_timeout_ms / 1000
        members = None
        if self.group is not None:
            slot, generation = handoff.slot, handoff.generation
            nonce = reservation_nonce(self.settings.capability_key(), slot, generation)  # (the table's own)
            members = self.group.push_members(
                slot, generation, nonce, handoff.detached.kv_tokens, targets, timeout_s, blocks
            )
        try:
            return push_handoff(
                self.backend,
                source,
                blocks,
                handoff,
                targets,
                layers_per_chunk=self.settings.layers_per_chunk,
                timeout_s=timeout_s,
                before_notify=None if members is None else members.wait,
            )
        finally:
            if members is not None:
                members.settle()

    # ---- the ServingRole of a decode process (process/roles.py) --------------------------------

    def add_to(self, server: grpc.aio.Server) -> None:
        worker_pb2_grpc.add_DecodeServicer_to_server(DecodeServicer(self), server)

    async def start(self, broker: BrokerClient | None = None) -> None:
        """Run the generation loop and the lease sweeper (the broker is not needed here)."""
        self.loop.start()
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep(), name="decode-lease-sweeper")

    async def _sweep(self) -> None:
        """Leases also lapse when nobody reserves: settle them so usage and quarantine are true."""
        while True:
            await asyncio.sleep(SWEEP_S)
            self.slots.expire()

    def close(self) -> None:
        """Stop using the pool and deregister it. The caller then finalizes the engine (its
        server stops, so no peer can be writing) and only then calls `free`."""
        if self._sweeper is not None:
            self._sweeper.cancel()
        self.loop.stop()
        self.handoffs.release_all()
        self._migrations.shutdown(wait=True)  # a push reading the pool ends before it is deregistered
        self._waiters.shutdown(wait=False, cancel_futures=True)
        self.pool.deregister()
        if self.group is not None:
            self.group.close()

    def free(self) -> None:
        self.pool.free()

    async def drain(self, timeout_s: float) -> bool:
        """Take no new slots; wait until every slot is free or `timeout_s` passed. True if drained."""
        mode = self.settings.drain_mode if self.supports_migration else "wait"
        if not self.draining:
            log.info(kv(event="decode_draining", busy=self.busy(), timeout_s=timeout_s, mode=mode))
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self.busy() and time.monotonic() < deadline:
            if mode != "wait":
                # Again each turn: a request whose KV arrives after the drain began joins the
                # batch and is handed over at the next one.
                self.loop.park_all(Handoff)
            await asyncio.sleep(0.05)
        drained = self.busy() == 0
        log.info(kv(event="decode_drained" if drained else "decode_drain_timeout", busy=self.busy()))
        return drained

    # ---- reporting ---------------------------------------------------------------------------

    def slot_usage(self) -> SlotUsage:
        """Grants by state (a paged pool's handles count as slots)."""
        usage = self.slots.usage()
        return usage.slots if isinstance(usage, BlockUsage) else usage

    def kv_tokens(self) -> tuple[int, int]:
        """(used, total) KV tokens: blocks held x block size, or slots taken x max_len."""
        usage = self.slots.usage()
        if isinstance(usage, BlockUsage):
            return usage.tokens_used, usage.tokens_total
        return (self.layout.num_slots - usage.free) * self.layout.max_len, self.layout.kv_tokens

    def busy(self) -> int:
        """Slots reserved or decoding (quarantined ones hold nobody's request)."""
        usage = self.slot_usage()
        return usage.reserved + usage.committed

    def load(self) -> Load:
        usage = self.slot_usage()
        used, total = self.kv_tokens()
        return Load(
            slots_used=self.layout.num_slots - usage.free,
            slots_free=usage.free,
            active_requests=self.loop.active,
            kv_tokens_used=used,
            kv_tokens_total=total,
            migrated=self.metrics.handoffs["migrated"],
            migration_fallbacks=self.metrics.handoffs["failed"] + self.metrics.handoffs["released"],
        )

    def member_info(self) -> MemberInfo:
        mem_type = MemType.DEVICE if self.pool.mem_type == self.backend.api.MemType.MEM_DEVICE else MemType.HOST
        return MemberInfo(
            worker_id=self.settings.member_id,
            role=Role.DECODE,
            grpc_endpoint=self.settings.grpc_endpoint,
            engine_id=self.settings.engine_id,
            regions=(MemoryRegion(self.pool.base_addr, self.pool.nbytes, mem_type),),
            kv_layout=self.layout,
            revision=self.revision,
            slots_total=self.layout.num_slots,
            slots_free=self.slot_usage().free,
            # A group's leader registers as one plain decode (routers use it alone, as it stands
            # for its whole group); the labels say what it is made of.
            labels={"model": self.engine.name, **(self.group.labels() if self.group is not None else {})},
        )

    def status(self) -> worker_pb2.DecodeStatus:
        load = self.load()
        return worker_pb2.DecodeStatus(
            worker_id=self.settings.member_id,
            slots_total=self.layout.num_slots,
            slots_used=load.slots_used,
            slots_free=load.slots_free,
            active_requests=load.active_requests,
            draining=self.draining,
            notifies_dropped=self.readiness.drops.total(),
            transfer_refusals=transfer_refusals(self.backend),
            kv_tokens_used=load.kv_tokens_used,
            kv_tokens_total=load.kv_tokens_total,
        )

    # ---- the request road --------------------------------------------------------------------

    def kv_bytes(self, num_tokens: int) -> int:
        """Bytes of KV that `num_tokens` prompt tokens occupy (every layer of the model, K and V:
        in this pool, or across a group's pools; every KV head, across a tensor-parallel
        decode's ranks)."""
        tp = self.engine.tp
        heads = self.layout.kv_heads if tp is None else tp.config.num_kv_heads
        per_token = heads * self.layout.head_dim * DTYPE_SIZES[self.layout.dtype]
        return num_tokens * per_token * 2 * self.engine.config.num_layers

    async def wait_ready(self, slot: int, generation: int, timeout_s: float) -> Ready:
        started = time.monotonic()
        try:
            message = await asyncio.get_running_loop().run_in_executor(
                self._waiters, self.readiness.wait, slot, generation, timeout_s
            )
        except ReadinessTimeout:
            self.metrics.observe_transfer_failure()
            raise
        try:
            num_tokens, first_token = int(message["num_tokens"]), int(message["first_token"])
        except (KeyError, TypeError, ValueError):
            # (The message itself is not quoted: it carries the reservation's nonce.)
            raise ReadyUnusable(
                f"the ready message of slot {slot} generation {generation} lacks an integer num_tokens or first_token"
            ) from None
        try:
            logprobs = message.get("first_logprobs")
            first_logprobs = None if logprobs is None else TokenLogprobs.from_wire(logprobs, MAX_LOGPROBS)
        except ValueError as exc:
            raise ReadyUnusable(f"the ready message of slot {slot} generation {generation}: {exc}") from None
        if self.group is not None:  # a group's request starts once every member's KV is there
            answers = await self.group.wait_ready(slot, generation, timeout_s)
            if any(a != (num_tokens, first_token) for a in answers):
                raise ReadyUnusable(
                    f"slot {slot} generation {generation}: members disagree on (num_tokens, "
                    f"first_token): leader {(num_tokens, first_token)}, followers {answers}"
                )
        waited = time.monotonic() - started
        pushed = self.kv_bytes(num_tokens - self.shared_tokens(slot, generation))
        self.metrics.observe_transfer(pushed, waited)
        return Ready(num_tokens, first_token, waited, message, first_logprobs, pushed)


def pool_tokens(settings: WorkerSettings, full: KVLayout) -> int:
    """The paged pool's tokens when `kv_tokens` is unset: the slots' memory (slots x max_len),
    capped by the decode's memory (kv/memory_budget.py, `auto_kv_tokens`); logged either way."""
    bt = settings.kv_block_tokens
    if not bt:
        return 0
    wanted = full.num_slots * full.max_len
    per_token = full.num_layers * 2 * full.bytes_per_token
    limit, resident = own_memory(settings.device)
    tokens = auto_kv_tokens(wanted, limit.bytes, settings.memory_share, per_token, bt, resident)
    fields = dict(tokens=tokens, wanted=wanted, bytes=tokens * per_token, limit_bytes=limit.bytes)
    fields |= dict(limit_source=limit.source, share=round(settings.memory_share, 4), resident_bytes=resident)
    if tokens < wanted // bt * bt:
        log.warning(kv(event="kv_pool_capped_by_memory", **fields))
    else:
        log.info(kv(event="kv_pool_size", mode="auto", **fields))
    return tokens


def paged_layout(layout: KVLayout, block_tokens: int, kv_tokens: int) -> KVLayout:
    """`layout` (slots of max_len) as a paged pool of `kv_tokens` tokens (0: the slots' memory)
    in blocks of `block_tokens`; unchanged when `block_tokens` is 0."""
    if not block_tokens:
        return layout
    tokens = kv_tokens or layout.num_slots * layout.max_len
    if tokens < block_tokens:
        raise ValueError(f"kv_tokens ({tokens}) holds not one block of {block_tokens} tokens")
    return replace(layout, block_tokens=block_tokens, num_blocks=tokens // block_tokens)


def migration_mismatch(ready: Ready, prompt: list[int], num_generated: int, seed: int | None) -> str | None:
    """Why a migration's ready notify does not fit the request the router described (None: it
    fits): the source's state must be exactly the stream the router spliced, or the text would
    fork."""
    m = ready.message
    if not m.get(MIGRATED):
        return "a prefill's KV came for a migrated request"
    if ready.num_tokens != len(prompt) - 1 or ready.first_token != prompt[-1]:
        return (
            f"the source pushed {ready.num_tokens} tokens of KV ending before token {ready.first_token}, "
            f"the request has {len(prompt)} tokens ending with {prompt[-1]}"
        )
    if m.get("num_generated") != num_generated or m.get("seed") != seed:
        return "the source's generation state (tokens generated, seed) differs from the request's"
    return None


def transfer_refusals(backend: TransferBackend) -> int:
    """What the engine's server refused so far (host engine; real HIXL counts nothing)."""
    if backend.host is None:
        return 0
    stats = backend.host.security_stats()
    return sum(v for k, v in stats.items() if k not in ("links_open", "handshakes_pending", "write_leases"))


@dataclass
class _Generation:
    """One Generate call's state on the decode: what was asked, the span, and how far it got."""

    request: worker_pb2.GenerateRequest
    where: str
    prompt: list[int]
    resumed: int  # tokens the client already has (a resume or a migration)
    params: SamplingParams
    stop_ids: frozenset[int]
    timeout_s: float
    trace: Any
    index: int = 0  # the next event's index
    first: int | None = None  # the token the batch starts from
    stream: RequestStream | None = None
    finished: bool = False
    steps: int = 0
    first_step_ns: int = 0
    last_step_ns: int = 0

    @property
    def slot(self) -> int:
        return self.request.slot

    @property
    def generation(self) -> int:
        return self.request.generation


def _kv_problem(g: _Generation, ready: Ready) -> str | None:
    """Why the KV that arrived is not this request's (None: it is)."""
    if g.request.migrated:
        return migration_mismatch(ready, g.prompt, g.resumed, g.params.seed)
    if ready.message.get(MIGRATED):
        return "a migration's KV came for a prefilled request"
    if ready.num_tokens != len(g.prompt):
        return f"prefill pushed {ready.num_tokens} tokens of KV, the prompt has {len(g.prompt)}"
    if g.params.logprobs is not None and ready.first_logprobs is None:
        return "the request asks for logprobs; the prefill's ready message has none for the first token"
    return None


class DecodeServicer(worker_pb2_grpc.DecodeServicer):
    """worker.proto's Decode service over a `DecodeWorker` (auth ran before these methods)."""

    def __init__(self, worker: DecodeWorker) -> None:
        self.w = worker

    async def Reserve(self, request: worker_pb2.ReserveRequest, context: grpc.aio.ServicerContext) -> worker_pb2.Grant:
        w = self.w
        if w.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"decode {w.settings.member_id} is draining")
        need = request.num_prompt_tokens + request.max_tokens
        if request.num_prompt_tokens == 0 or need > w.layout.max_len:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"num_prompt_tokens ({request.num_prompt_tokens}) + max_tokens ({request.max_tokens}) = {need} "
                f"must be in 1..{w.layout.max_len} (the slots' max_len)",
            )
        ttl_s = (request.lease_ms or w.settings.lease_ms) / 1000
        try:
            share = (request.share_from.slot, request.share_from.generation) if request.HasField("share_from") else None
            grant = w.reserve(
                request.request_id, ttl_s, request.num_prompt_tokens, request.max_tokens, share, request.keep_for_copies
            )
        except NoFreeSlot as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        log.debug(
            kv(
                event="slot_granted",
                request=request.request_id,
                slot=grant.slot,
                generation=grant.generation,
                shared_blocks=grant.shared,
            )
        )
        if grant.shared:
            w.metrics.kv_shared_blocks.inc(grant.shared)
        deadline_ms = int((time.time() + ttl_s) * 1000)
        reply = grant_to_proto(grant, worker_id=w.settings.member_id, lease_deadline_unix_ms=deadline_ms)
        reply.group_grants.extend(
            grant_to_proto(g, worker_id=w.settings.member_id, lease_deadline_unix_ms=deadline_ms)
            for g in w.group_grants(grant)
        )
        return reply

    async def Generate(self, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        """Validate, wait for the KV, start the request in the batch, stream its tokens. Every way
        out passes `_end`, which frees the slot unless the loop already owns it."""
        g = await self._validated(request, context)
        try:
            ready = await self._await_kv(g, context)
            g.stream = self._start_stream(g, ready)
            async for out in g.stream:
                if isinstance(out, Parked):  # this decode is draining: hand the request over
                    g.trace.set_attribute("pdserve.handed_over", True)
                    yield await self._handover_event(out.handoff, g.generation, g.index, context, g.where)
                    await self._await_migrate(out.handoff, context, g.where)
                    return
                event = await self._token_event(g, out, ready, context)
                if event is None:
                    continue
                yield event
                if g.finished:
                    return
        except RequestFailed as exc:
            await context.abort(grpc.StatusCode.INTERNAL, f"{g.where}: {exc}")
        except BaseException as exc:
            g.trace.record_exception(exc)
            raise
        finally:
            self._end(g)

    async def _validated(self, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> _Generation:
        """The request's checks (INVALID_ARGUMENT), and the claim on its grant: from here its
        lease lasts as long as we are willing to wait for the KV."""
        w = self.w
        slot, generation, prompt = request.slot, request.generation, list(request.prompt_token_ids)
        where = f"slot {slot} generation {generation} (request {request.request_id})"
        resumed = request.num_generated
        if resumed >= len(prompt):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{where}: num_generated ({resumed}) must be below the {len(prompt)} tokens of "
                "prompt_token_ids (the prompt, then the tokens already streamed)",
            )
        if request.migrated and resumed < 1:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{where}: a migrated request has streamed tokens (num_generated >= 1), got 0",
            )
        try:
            params = sampling_from_proto(request.sampling)
        except ValidationError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{where}: sampling: {exc}")
        timeout_s = (request.readiness_timeout_ms or w.settings.readiness_timeout_ms) / 1000
        problem = w.note_prompt(slot, generation, prompt)
        if problem is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{where}: {problem}")
        if not w.slots.renew(slot, generation, timeout_s + 5.0):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{where} is not a live grant")
        # A streaming handler: its span is ended by hand (tracing.py on spans across yields).
        trace = tracing.start_span(
            "decode.generate",
            {
                "pdserve.request_id": request.request_id,
                "pdserve.decode.member": w.settings.member_id,
                "pdserve.slot": slot,
                "pdserve.slot.generation": generation,
                "gen_ai.usage.input_tokens": len(prompt),
                "pdserve.resumed_tokens": resumed or None,
            },
            parent=tracing.extract(context.invocation_metadata()),
        )
        stop_ids = stop_token_ids(params, w.engine.tokenizer.eos_token_ids)
        return _Generation(request, where, prompt, resumed, params, stop_ids, timeout_s, trace, index=resumed)

    async def _await_kv(self, g: _Generation, context: grpc.aio.ServicerContext) -> Ready:
        """Wait for the prefill's (or a migration's) ready notice, check that its KV is this
        request's, and commit the slot."""
        w, slot, generation, where = self.w, g.slot, g.generation, g.where
        try:
            wait_ns = tracing.now_ns()
            ready = await w.wait_ready(slot, generation, g.timeout_s)
            tracing.record(
                "decode.notify_wait",
                wait_ns,
                tracing.now_ns(),
                {"pdserve.readiness": w.settings.readiness_mode, "pdserve.ready_wait_s": ready.wait_s},
                parent=g.trace,
            )
        except ReadinessTimeout as exc:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"{where}: {exc}")
        except SlotNotReserved as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{where}: {exc}")
        except ReadyUnusable as exc:
            await context.abort(grpc.StatusCode.ABORTED, f"{where}: {exc}")
        except MemberUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{where}: {exc}")
        problem = _kv_problem(g, ready)
        if problem is not None:
            await context.abort(grpc.StatusCode.ABORTED, f"{where}: {problem}")
        if not w.slots.commit(slot, generation):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{where}: the lease ended before the KV arrived")
        return ready

    def _start_stream(self, g: _Generation, ready: Ready) -> RequestStream:
        """Hand the slot to the generation loop: from here the loop owns it and frees it when the
        request leaves the batch."""
        w, slot, generation, prompt = self.w, g.slot, g.generation, g.prompt
        w.adopt(slot, generation)
        # A migrated request: its KV lacks the last streamed token, which joins the batch as
        # the "first" token (its output, already streamed by the source, is not sent again).
        migrated = g.request.migrated
        kv_ids, g.first, replayed = (
            (prompt[:-1], prompt[-1], g.resumed - 1) if migrated else (prompt, ready.first_token, g.resumed)
        )
        if migrated:
            w.metrics.migrations_received.inc()
        g.index = replayed  # a resumed stream goes on at the index where the broken one stopped
        return w.loop.submit(
            g.request.request_id,
            kv_ids,
            slot,
            g.params,
            lambda: w.finished(slot, generation),
            first_token=g.first,
            num_generated=replayed,
            first_logprobs=None if migrated else ready.first_logprobs,
        )

    async def _token_event(
        self, g: _Generation, out: Any, ready: Ready, context: grpc.aio.ServicerContext
    ) -> worker_pb2.TokenEvent | None:
        """The stream's event for one generated token (None: a replayed token, not sent again)."""
        g.last_step_ns = tracing.now_ns()
        g.first_step_ns = g.first_step_ns or g.last_step_ns
        g.steps += 1
        if g.index < g.resumed:  # (a migrated request's last streamed token, replayed)
            if out.finished or out.token_id != g.first:
                await context.abort(
                    grpc.StatusCode.ABORTED, f"{g.where}: the migrated state does not replay to its last token"
                )
            g.index += 1
            return None
        event = worker_pb2.TokenEvent(index=g.index, text=out.text)
        if out.token_id is not None:
            event.token_id = out.token_id
        if out.logprobs is not None:
            event.logprobs.CopyFrom(logprobs_to_proto(out.logprobs))
        if g.index == g.resumed:
            event.kv_bytes_received = ready.kv_bytes
            event.kv_pushed = True
            event.ready_wait_s = ready.wait_s
            event.num_prompt_tokens = ready.num_tokens
        if out.finished:
            g.finished = True
            event.finish_reason = finish_reason_to_proto(out.finish_reason or FinishReason.STOP)
            if out.finish_reason is FinishReason.STOP and out.token_id in g.stop_ids:
                event.stop = str(out.token_id)  # a stop token; a stop string is not reported back
        g.index += 1
        return event

    def _end(self, g: _Generation) -> None:
        """Every way out of Generate: the steps' span, then the slot — released if never
        committed (quarantined: a push may be in flight), else cancelled in the loop, which frees
        it once the request is out of the batch."""
        if g.steps:
            # One span for all the steps, not one per token: the first token came with the KV
            # (sampled by the prefill), every later one is a decode step in the batch.
            steps, first, last = g.steps, g.first_step_ns, g.last_step_ns
            tracing.record(
                "decode.steps",
                first,
                last,
                {
                    "pdserve.decode.steps": steps - 1,
                    "gen_ai.usage.output_tokens": steps,
                    "pdserve.decode.mean_step_ms": round((last - first) / 1e6 / (steps - 1), 3) if steps > 1 else None,
                    "pdserve.finished": g.finished,
                },
                parent=g.trace,
            )
        g.trace.set_attribute("pdserve.finished", g.finished)
        g.trace.end()
        if g.stream is None:
            self.w.slots.release(g.slot, g.generation)
        elif not g.finished:
            self.w.loop.cancel(g.stream)

    async def _handover_event(
        self, handoff: Handoff, generation: int, index: int, context: grpc.aio.ServicerContext, where: str
    ) -> worker_pb2.TokenEvent:
        """The request was parked for a migration: the event that tells the router (`handover`),
        after the handoff is filed for the router's Migrate (drain mode resume: an error instead)."""
        w = self.w
        d = handoff.detached
        if index != len(d.output_ids):  # the stream and the generator disagree: never splice on that
            handoff.release()
            await context.abort(
                grpc.StatusCode.INTERNAL, f"{where}: parked after {len(d.output_ids)} tokens, streamed {index}"
            )
        if w.settings.drain_mode == "resume":
            handoff.release()
            w.metrics.observe_handoff(handoff.outcome or "released")
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"{where}: decode {w.settings.member_id} is draining: resume the request elsewhere",
            )
        w.handoffs.add(handoff, generation)
        return worker_pb2.TokenEvent(
            index=index,
            handover=worker_pb2.Handover(num_generated=len(d.output_ids), seed=d.seed, kv_tokens=d.kv_tokens),
        )

    async def _await_migrate(self, handoff: Handoff, context: grpc.aio.ServicerContext, where: str) -> None:
        """Keep the KV until the router's Migrate pushed it or `migrate_wait_seconds` passed; then
        the handoff is released (a no-op after a Migrate) and the stream ends."""
        w = self.w
        deadline = time.monotonic() + w.settings.migrate_wait_seconds
        while not handoff.settled and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if handoff.state == Handoff.PARKED:
            handoff.release()
            w.metrics.observe_handoff(handoff.outcome or "released")
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"{where}: handed over, but no Migrate came within {w.settings.migrate_wait_seconds:g}s",
            )

    async def Migrate(
        self, request: worker_pb2.MigrateRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.MigrateReply:
        w = self.w
        where = f"slot {request.slot} generation {request.generation} (request {request.request_id})"
        try:
            handoff = w.handoffs.take(request.request_id, request.slot, request.generation)
        except HandoffUnavailable as exc:
            context.set_trailing_metadata(settled_trailer(True))
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        try:
            targets = push_targets_from_proto(request)
        except ValueError as exc:
            handoff.finish(migrated=False)
            w.metrics.observe_handoff(handoff.outcome or "released")
            context.set_trailing_metadata(settled_trailer(True))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{where}: {exc}")
        started, started_ns = time.monotonic(), tracing.now_ns()
        push = asyncio.get_running_loop().run_in_executor(w._migrations, w.push_handoff, handoff, targets)
        # However this call ends (even cancelled), the KV is freed only once the push stopped reading it.
        push.add_done_callback(lambda f: handoff.finish(migrated=not f.cancelled() and f.exception() is None))
        try:
            result = await asyncio.shield(push)
        except (PushError, TransferError, ValueError, MemberUnavailable) as exc:
            w.metrics.observe_handoff(handoff.outcome or "released")
            log.warning(kv(event="migration_failed", request=request.request_id, slot=request.slot, error=str(exc)))
            # A push that failed was aborted: its puts reached a terminal state or were given up on.
            context.set_trailing_metadata(settled_trailer(isinstance(exc, ValueError)))
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{where}: migration failed: {exc}")
        seconds = time.monotonic() - started
        w.metrics.observe_handoff(handoff.outcome or "migrated", result.stats.bytes, seconds)
        tracing.record(
            "decode.migrate",
            started_ns,
            tracing.now_ns(),
            {
                "pdserve.request_id": request.request_id,
                "pdserve.decode.member": w.settings.member_id,
                "pdserve.kv_tokens": result.num_tokens,
                "pdserve.kv_bytes": result.stats.bytes,
            },
            parent=tracing.extract(context.invocation_metadata()),
        )
        log.info(
            kv(
                event="request_migrated",
                request=request.request_id,
                tokens=result.num_tokens,
                bytes=result.stats.bytes,
                seconds=f"{seconds:.4f}",
                targets=",".join(t.engine_id for t in targets),
            )
        )
        return worker_pb2.MigrateReply(
            num_tokens=result.num_tokens, kv_bytes=result.stats.bytes, push_seconds=result.stats.seconds
        )

    async def Release(
        self, request: worker_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ReleaseReply:
        # Only a grant still waiting for its Generate (or quarantined for it) is released here; a
        # committed slot is the generation loop's until its request leaves the batch.
        released = self.w.slots.release_grant(request.slot, request.generation, push_settled=request.push_settled)
        log.debug(
            kv(
                event="grant_released",
                request=request.request_id,
                slot=request.slot,
                generation=request.generation,
                push_settled=request.push_settled,
                released=released,
            )
        )
        return worker_pb2.ReleaseReply(released=released)

    async def Status(
        self, request: worker_pb2.StatusRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.DecodeStatus:
        return self.w.status()
