"""The decode role: a KV pool registered with the transfer engine, grants with leases, token streams.

The router `Reserve`s a slot (a handle, a generation and, paged by default, the blocks for
prompt + max_tokens) and opens `Generate` with the grant; the call waits for the ready
notification a prefill sends after its push, then the request joins the continuous batch of
the `GenerationLoop` (decode/service.py, decode/generate_call.py).

One owner frees a slot: before the KV was committed, `SlotTable.release` quarantines it (a
prefill may still be writing); after commit, the generation loop frees it once the request
left the batch. Draining refuses new grants and hands running requests over (decode/
migration.py), ends them for the router to resume, or lets them finish, per `drain_mode`.
The full account: docs/roles.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from pdserve.v1 import worker_pb2
from pdserve_common.kv_layout import DTYPE_SIZES, KVLayout
from pdserve_common.logs import kv
from pdserve_common.membership import Load, MemberInfo, MemoryRegion, MemType, Role
from pdserve_worker.decode.group_hooks import GroupHooks
from pdserve_worker.decode.handover import Handover
from pdserve_worker.decode.local_prefill import decode_loop
from pdserve_worker.decode.migration import Handoff
from pdserve_worker.engines.base import Engine
from pdserve_worker.kv.block_events import BlockEventLog
from pdserve_worker.kv.blocks import BlockTable, BlockUsage
from pdserve_worker.kv.cache import KVCache
from pdserve_worker.kv.decode_prefix import CachedPrompt, DecodePrefixCache
from pdserve_worker.kv.memory_budget import auto_kv_tokens, own_memory
from pdserve_worker.kv.paged import PagedKVCache
from pdserve_worker.kv.prefix_cache import cache_salt
from pdserve_worker.kv.slots import Grant, SlotTable, SlotUsage
from pdserve_worker.model.engine import Generator
from pdserve_worker.model.sampling.params import MAX_LOGPROBS, TokenLogprobs
from pdserve_worker.rpc.broker_client import BrokerClient
from pdserve_worker.serving.costs import CostMeter
from pdserve_worker.serving.settings import WorkerSettings
from pdserve_worker.serving.worker_metrics import WorkerMetrics
from pdserve_worker.transfer.base import TransferBackend
from pdserve_worker.transfer.digest import KVIntegrityError, ReadyDigests
from pdserve_worker.transfer.leases import BlockWriteLeases, SlotWriteLeases
from pdserve_worker.transfer.pool import KVPool
from pdserve_worker.transfer.readiness import Readiness, ReadinessTimeout

log = logging.getLogger(__name__)

SWEEP_S = 1.0  # how often lapsed leases are looked for


class ReadyUnusable(RuntimeError):
    """The ready notification(s) for a slot cannot be decoded from: malformed, for another
    prompt length, or a layer-sharded group's members disagree. The push is at fault, not this
    decode: Generate answers ABORTED, which the router retries with another prefill."""


class KVDamaged(ReadyUnusable):
    """The KV that landed does not match its digest (transfer/digest.py): damaged on its way,
    neither worker is to blame. Generate answers DATA_LOSS, which the router retries as it is."""


@dataclass(frozen=True)
class Ready:
    """What the ready notification told us about a slot's KV."""

    num_tokens: int
    first_token: int
    wait_s: float
    message: dict[str, Any] = field(default_factory=dict)  # the whole notify (a migration's state)
    first_logprobs: TokenLogprobs | None = None  # the first token's, drawn by the prefill
    kv_bytes: int = 0  # what was pushed for it (not the blocks shared with another copy)
    kv_pushed: bool = True  # False: this decode computed the prompt itself (decode/local_prefill.py)


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
        self.settings, self.engine, self.backend, self.revision, self.group = settings, engine, backend, revision, group
        full = engine.kv_layout(settings.slots, settings.max_length, settings.model_dtype)
        # Paged unless kv_block_tokens is 0; a layer-sharded group keeps max-length slots.
        layout = decode_pool_layout(settings, full) if group is None else group.pool_layout(full)
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
        self.digests = ReadyDigests(backend.digest, self.pool.base_addr, layout, self.slots.grant_of)
        self.readiness.check = self.digests.check
        generator = Generator(engine, engine.tokenizer, cache) if group is None else group.generator(engine, cache)
        self.costs = CostMeter()  # reported for the router's conditional disaggregation
        self.local_prefill, self.loop = decode_loop(generator, settings, engine, cache, self.costs, group is None)
        # One blocking readiness wait per request that waits: at most one per slot.
        self._waiters = ThreadPoolExecutor(max_workers=layout.num_slots, thread_name_prefix="decode-ready")
        self.draining = False
        self._sweeper: asyncio.Task[None] | None = None
        self.metrics = WorkerMetrics("decode")  # served on /metrics (worker_main)
        self.fatal: str | None = None  # (ServingRole: a broken TP group ends the process itself, ranks/decode.py)
        self._watch()
        # Requests handed over while draining (decode/migration.py), and the one thread that pushes them.
        self.handover = Handover(settings, backend, self.pool, self.slots, group)
        self.handoffs = self.handover.book

    def _own_the_pool(self, layout: KVLayout, quarantine_s: float) -> Any:
        """The pool's one grant owner, its write leases and the cache view over it: blocks for
        a paged pool, slots otherwise; returns the pool's warm-up."""
        settings, base_addr, paged = self.settings, self.pool.base_addr, layout.paged
        self.leases = (BlockWriteLeases if paged else SlotWriteLeases)(self.backend, base_addr, layout)
        if self.group is not None:
            self.leases = self.group.write_leases(self.leases)  # (a tensor-parallel decode's other ranks too)
        self.slots: SlotTable | BlockTable = grant_table(settings, layout, quarantine_s, self.leases, base_addr)
        if isinstance(self.slots, BlockTable) and self.group is None and settings.decode_prefix_cache:
            self.slots.prefix = decode_prefix_cache(self.revision, layout)  # ended requests' blocks, for later prompts
        self.cache: KVCache | PagedKVCache = self.engine.bind_pool(layout, self.pool.tensor)
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
        if isinstance(self.slots, BlockTable) and (prefix := self.slots.prefix) is not None:
            self.metrics.watch_decode_prefix(lambda: len(prefix), lambda: prefix.hit_blocks)

    # ---- what a paged pool adds to the request road (kv/blocks.py) --------------------------------

    def reserve(
        self,
        request_id: str,
        ttl_s: float,
        num_prompt_tokens: int,
        max_tokens: int,
        share_from: tuple[int, int] | CachedPrompt | None = None,
        keep_for: int = 0,
    ) -> Grant:
        """A grant for a request of `num_prompt_tokens` + `max_tokens`: a slot, or the blocks of
        exactly that many tokens (raises NoFreeSlot, or its NoFreeBlocks, when there is no room).
        `share_from`: another copy of the prompt decoding here, whose whole prompt blocks a paged
        pool shares read-only (as many as are still there; a slot pool has none to share);
        `keep_for`: the later copies of this one's prompt, which will ask to share it. A
        CachedPrompt: the blocks of its prefix the prefix cache holds (kv/decode_prefix.py)."""
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
        if isinstance(self.slots, BlockTable):
            self.engine.bind_blocks(self.cache, slot, self.slots.blocks_of(slot))

    def finished(self, slot: int, generation: int) -> None:
        """The request left the batch: its blocks are nobody's to read, and the grant is freed."""
        self.engine.free_blocks(self.cache, slot)
        self.slots.release(slot, generation)

    def _warm_blocks(self, slot: int, num_tokens: int) -> None:
        blocks = self.slots.blocks_of(slot)
        bt = self.layout.block_tokens
        self.pool.warm_blocks(blocks[: -(-num_tokens // bt)])

    def group_grants(self, grant: Grant) -> list[Grant]:
        """Every member's grant of a layer-sharded group's slot; none for an unsharded decode."""
        return [] if self.group is None else self.group.grants(grant)

    # ---- the ServingRole of a decode process (process/roles.py) --------------------------------

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
        self.handover.close()  # a push reading the pool ends before it is deregistered
        self._waiters.shutdown(wait=False, cancel_futures=True)
        self.pool.deregister()
        if self.group is not None:
            self.group.close()

    def free(self) -> None:
        self.pool.free()

    async def drain(self, timeout_s: float) -> bool:
        """Take no new slots; wait until every slot is free or `timeout_s` passed. True if drained."""
        mode = self.settings.drain_mode if self.handover.supported else "wait"
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
            prefill_tokens_per_s=self.costs.prefill_tokens_per_s,
            step_seconds=self.costs.steps(self.loop.stats.steps, self.loop.stats.busy_s),
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
            local_prefill=self.local_prefill is not None,
            prefill_chunk_tokens=self.settings.prefill_chunk_tokens if self.local_prefill is not None else 0,
        )

    def status(self) -> worker_pb2.DecodeStatus:
        # (not `load()`: that closes the keepalive's window of step times)
        free, (used, total) = self.slot_usage().free, self.kv_tokens()
        return worker_pb2.DecodeStatus(
            worker_id=self.settings.member_id,
            slots_total=self.layout.num_slots,
            slots_used=self.layout.num_slots - free,
            slots_free=free,
            active_requests=self.loop.active,
            draining=self.draining,
            notifies_dropped=self.readiness.drops.total(),
            transfer_refusals=transfer_refusals(self.backend),
            kv_tokens_used=used,
            kv_tokens_total=total,
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
        except KVIntegrityError as exc:  # (the router re-prefills the request: an ABORTED Generate)
            self.metrics.kv_digest_failures.labels(exc.reason).inc()
            raise (KVDamaged if exc.reason == "mismatch" else ReadyUnusable)(str(exc)) from None
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


def decode_pool_layout(settings: WorkerSettings, full: KVLayout) -> KVLayout:
    """A decode's own pool: `full` paged in `kv_block_tokens` blocks (unless 0), `kv_tokens` of
    them or as many as `pool_tokens` sizes."""
    return paged_layout(full, settings.kv_block_tokens, settings.kv_tokens or pool_tokens(settings, full))


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


def transfer_refusals(backend: TransferBackend) -> int:
    """What the engine's server refused so far (host engine; real HIXL counts nothing)."""
    if backend.host is None:
        return 0
    stats = backend.host.security_stats()
    return sum(v for k, v in stats.items() if k not in ("links_open", "handshakes_pending", "write_leases"))


def grant_table(
    settings: WorkerSettings, layout: KVLayout, quarantine_s: float, leases: Any, base_addr: int
) -> SlotTable | BlockTable:
    """A decode pool's one grant owner: blocks for a paged pool, max-length slots otherwise."""
    table = BlockTable if layout.paged else SlotTable
    key = settings.capability_key()
    return table(
        layout,
        engine_id=settings.engine_id,
        base_addr=base_addr,
        quarantine_s=quarantine_s,
        capability_key=key,
        leases=leases,
    )


def decode_prefix_cache(revision: str, layout: KVLayout) -> DecodePrefixCache:
    """The prefix cache of a decode's pool, named as a prefill of the same model names blocks,
    with the block events routers follow."""
    prefix = DecodePrefixCache(cache_salt(revision, layout.dtype, layout.block_tokens), layout.block_tokens)
    prefix.events = BlockEventLog(prefix.held)
    return prefix
