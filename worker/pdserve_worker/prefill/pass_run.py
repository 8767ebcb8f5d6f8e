"""The prefill role: compute a prompt's KV layer chunk by layer chunk, pushing each chunk as it is done.

`engine.prefill(cache, PrefillPass(..., on_chunk=...))` writes each layer chunk's KV into a
scratch pool registered with the transfer engine, and the prompt's pusher puts that chunk at
once, so the transfer of chunk k overlaps the compute of chunk k+1. The first token is sampled
here and sent in the ready notification after every put completed: a decode never reads a
partial push. Any failure aborts the push and sends no notification.

Queued prompts share one pass (up to `prefill_batch`, within `prefill_token_budget`), on one
compute thread; short prompts overtake a long pass between its layer chunks. The prefix cache
(kv/prefix_store.py) supplies each prompt's longest cached prefix within its cache scope.
A cancelled or failed prompt ends alone, and its reply's trailer says whether its push is over
(rpc/trailers.py). The full account: docs/roles.md.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from pdserve_common import tracing
from pdserve_common.logs import kv
from pdserve_common.membership import EventType, Load, MemberEvent, MemberInfo, Role
from pdserve_worker.engines.base import Engine, PrefillPass
from pdserve_worker.kv.cache import KVCache
from pdserve_worker.kv.prefix_store import PrefixStoreConfig, PrefixUse, open_prefix_store
from pdserve_worker.kv.slots import Grant
from pdserve_worker.model.sampling.params import SamplingParams, TokenLogprobs
from pdserve_worker.model.sampling.sampler import draw_first, stop_token_ids
from pdserve_worker.ranks.group import TPGroup
from pdserve_worker.ranks.prefill import (
    IDLE,
    STOP,
    PassPlan,
    PassPrompt,
    RankReport,
    check_targets,
    pushed_heads,
    scratch_layout,
)
from pdserve_worker.rpc.broker_client import BrokerClient
from pdserve_worker.serving.settings import WorkerSettings
from pdserve_worker.serving.worker_metrics import WorkerMetrics
from pdserve_worker.transfer.base import TransferBackend
from pdserve_worker.transfer.pool import KVPool
from pdserve_worker.transfer.push import KVPusher, PushError, PushSource

log = logging.getLogger(__name__)

# A Cancel that arrives before its Prefill is remembered this long, for at most this many ids.
CANCEL_MEMORY_S = 60.0
CANCEL_MEMORY_MAX = 4096

JobKey = tuple[str, int, int]  # (request_id, slot, generation) of the request's first target


class PrefillCancelled(Exception):
    """The router cancelled this prefill (worker.proto's Prefill.Cancel)."""


class InstanceBroken(RuntimeError):
    """The tensor-parallel group of this instance broke (a rank died or hangs): the router tries
    another prefill (UNAVAILABLE), and this one restarts as one."""


class _AllEnded(Exception):
    """Every prompt of a pass has ended (failed or cancelled): stop computing it."""


@dataclass
class _Job:
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


def _keep_prompt_states(live: list[tuple[int, _Job]], starts: list[int], final: list[Any]) -> None:
    """Hand each prompt that asks for its logprobs its rows of the pass's packed final states."""
    if not final:
        return
    offset = 0
    for (_, job), start in zip(live, starts, strict=True):
        length = len(job.prompt) - start
        if job.echo:
            job.prompt_states = final[0][offset : offset + length]
        offset += length


def _mark(exc: BaseException, settled: bool) -> BaseException:
    """Note on a prefill's failure whether its push is over (read by the servicer)."""
    exc.push_settled = settled  # type: ignore[attr-defined]
    return exc


def push_settled_of(exc: BaseException) -> bool:
    return bool(getattr(exc, "push_settled", False))


@dataclass(frozen=True)
class PrefillResult:
    first_token: int
    num_tokens: int
    kv_bytes: int
    push_seconds: float
    prefill_seconds: float
    cached_tokens: int = 0
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()  # prompt tokens 1..n-1's, when asked for


class PrefillWorker:
    def __init__(
        self,
        settings: WorkerSettings,
        engine: Engine,
        backend: TransferBackend,
        revision: str,
        group: TPGroup | None = None,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.backend = backend
        self.revision = revision
        # Rank 0 of a tensor-parallel instance (ranks/prefill.py): the others follow its passes.
        self.group = group
        self.fatal: str | None = None  # why the instance must restart (its group broke)
        self._last_collective = time.monotonic()
        self._heartbeat: asyncio.Task[None] | None = None
        # One scratch slot per prompt of a pass (a tensor-parallel rank's: its KV heads only).
        layout = scratch_layout(settings, engine)
        self.pool = KVPool(backend, layout, device=settings.device)
        self.cache = KVCache(layout, self.pool.tensor)
        self.source = PushSource(self.pool.base_addr, layout, slot=0, heads=pushed_heads(engine))
        if group is not None and settings.prefix_cache_tokens != 0:
            log.info(kv(event="prefix_cache_off", reason="tensor_parallel", tp=group.size))
        self.prefix = (
            None
            if group is not None
            else open_prefix_store(
                layout,
                PrefixStoreConfig(
                    settings.prefix_cache_tokens,
                    settings.memory_share,
                    settings.prefix_block_tokens,
                    revision,
                    disk_dir=settings.prefix_disk_dir,
                    disk_bytes=settings.prefix_disk_bytes,
                    disk_key=settings.prefix_disk_key() if settings.prefix_disk_dir is not None else b"",
                ),
                device=settings.device,
                logger=log,
            )
        )
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefill-compute")
        self._pending: deque[_Job] = deque()
        self._overtaking = False  # a short pass runs inside a long one's (compute thread only)
        self._lock = threading.Lock()
        self.queued = 0  # requests accepted and not yet answered
        self.draining = False  # set by drain(): new prompts are refused
        self.served = 0
        self._jobs: dict[JobKey, _Job] = {}
        self._early_cancels: OrderedDict[JobKey, float] = OrderedDict()  # key -> when it is forgotten
        self.metrics = WorkerMetrics("prefill")  # served on /metrics (worker_main)
        p = self.prefix
        self.metrics.watch_prefill(
            lambda: self.queued,
            p.stats if p is not None else None,
            p.tier_stats if p is not None else None,
            p.block_bytes if p is not None else 0,
        )

    # ---- the ServingRole of a prefill process (process/roles.py) -----------------------------------

    async def start(self, broker: BrokerClient) -> None:
        """Follow the decode membership: a decode that leaves is disconnected (`on_member`); with
        tensor parallelism, keep the other ranks' wait for the next pass within its timeout."""
        await broker.watch([Role.DECODE], listener=self.on_member)
        if self.group is not None:
            self._heartbeat = asyncio.get_running_loop().create_task(self._keep_ranks_waiting(), name="tp-idle")

    async def _keep_ranks_waiting(self) -> None:
        period = self.group.spec.timeout_s / 4 if self.group is not None else 1.0
        while self.fatal is None:
            await asyncio.sleep(period / 2)
            if time.monotonic() - self._last_collective > period and not self.queued:
                self._compute.submit(self._tell_ranks, IDLE)

    def _tell_ranks(self, what: str) -> None:
        """(compute thread) IDLE or STOP to the other ranks, unless a pass just spoke to them."""
        if self.group is None or self.fatal is not None:
            return
        if what == IDLE and time.monotonic() - self._last_collective < self.group.spec.timeout_s / 8:
            return
        try:
            self.group.broadcast(what)
            self._last_collective = time.monotonic()
        except Exception as exc:  # a rank is gone: the instance restarts as one
            self._broken(exc)

    def _broken(self, exc: BaseException) -> None:
        """The group broke: refuse new prompts and stop the process (exit non-zero: worker_main)."""
        if self.fatal is None:
            self.fatal = f"tensor-parallel group broke: {exc}"
            log.error(kv(event="tp_group_broken", error=str(exc)))
            os.kill(os.getpid(), signal.SIGTERM)

    async def drain(self, timeout_s: float) -> bool:
        """Take no new prompts (a Prefill is refused UNAVAILABLE, nothing put: the router tries
        another prefill); wait until those queued or computing here are answered, or
        `timeout_s` passed. True if none is left. Called on the stop signal (a scale-down
        deletes the pod) after the broker was told this member is draining, so routers stop
        choosing it; what is still here at the timeout is cut by the gRPC server's stop and
        retried by its router (its decode reservation is given back)."""
        if not self.draining:
            log.info(kv(event="prefill_draining", queued=self.queued, timeout_s=timeout_s))
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self.queued and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        drained = self.queued == 0
        log.info(kv(event="prefill_drained" if drained else "prefill_drain_timeout", queued=self.queued))
        return drained

    def busy(self) -> int:
        return self.queued

    def member_info(self) -> MemberInfo:
        return MemberInfo(
            worker_id=self.settings.member_id,
            role=Role.PREFILL,
            grpc_endpoint=self.settings.grpc_endpoint,
            revision=self.revision,
            labels={"model": self.engine.name},
        )

    def load(self) -> Load:
        """Reported with each keepalive: requests queued or computing here (routers rank by it)."""
        return Load(active_requests=self.queued)

    def close(self) -> None:
        """Stop computing; `free` after the engine is finalized (no put of ours still reads)."""
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        self._compute.shutdown(wait=True, cancel_futures=True)
        if self.group is not None:  # the other ranks stop with us (no pass runs any more)
            self._tell_ranks(STOP)
            self.group.close()
        if self.prefix is not None:
            self.prefix.close()  # the disk tier's writes queued so far land
        self.pool.deregister()

    def free(self) -> None:
        self.pool.free()

    def on_member(self, event: MemberEvent) -> None:
        """A decode that left will not be pushed to again: drop the link to its engine."""
        member = event.member
        if event.type is EventType.REMOVED and member is not None and member.info.engine_id:
            status = self.backend.engine.disconnect(member.info.engine_id, 1000)
            log.info(
                kv(event="decode_disconnected", decode=member.worker_id, engine=member.info.engine_id, status=status)
            )

    def cancel(self, key: JobKey) -> bool:
        """Stop the prefill of `key`; True if it was here (queued or running). A key not seen yet
        is remembered (bounded), and its Prefill is refused when it arrives."""
        job = self._jobs.get(key)
        if job is not None:
            job.cancelled.set()
            return True
        now = time.monotonic()
        self._early_cancels[key] = now + CANCEL_MEMORY_S
        self._early_cancels.move_to_end(key)
        while self._early_cancels and (
            len(self._early_cancels) > CANCEL_MEMORY_MAX or next(iter(self._early_cancels.values())) < now
        ):
            self._early_cancels.popitem(last=False)
        return False

    async def prefill(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        targets: list[Grant],
        num_generated: int,
        trace: Any = None,
        cache_scope: str = "",
    ) -> PrefillResult:
        """Queue one prefill on the compute thread and wait for it (the event loop stays free).

        Raises `PrefillCancelled` when cancelled; every failure carries `push_settled`."""
        first = targets[0]
        key = (request_id, first.slot, first.generation)
        if self.fatal is not None:
            raise _mark(InstanceBroken(f"prefill {self.settings.member_id}: {self.fatal}"), True)
        if self._early_cancels.pop(key, 0.0) > time.monotonic():
            raise _mark(PrefillCancelled(f"prefill of request {request_id} was cancelled before it arrived"), True)
        loop = asyncio.get_running_loop()
        job = self._jobs[key] = _Job(
            request_id,
            prompt,
            params,
            targets,
            num_generated,
            time.perf_counter(),
            loop,
            loop.create_future(),
            trace=trace,
            cache_scope=cache_scope,
            # Read from the disk tier while the prompt waits its turn (nothing when none is there).
            prefetch=self.prefix.prefetch(prompt, cache_scope) if self.prefix is not None else None,
        )
        self.queued += 1
        try:
            with self._lock:
                self._pending.append(job)
            # One drain per job: a drain takes every job waiting then (up to the batch), so later
            # drains may find nothing left to do.
            self._compute.submit(self._drain)
            return await job.done
        except asyncio.CancelledError:
            job.cancelled.set()  # the caller went away: a queued prefill never starts, a running one stops
            raise
        finally:
            self.queued -= 1
            self._jobs.pop(key, None)

    def _take_batch(self) -> list[_Job]:
        """The waiting jobs of the next pass: up to `prefill_batch`, within `prefill_token_budget`."""
        s = self.settings
        batch: list[_Job] = []
        tokens = 0
        with self._lock:
            while self._pending and len(batch) < s.prefill_batch:
                if batch and tokens + len(self._pending[0].prompt) > s.prefill_token_budget:
                    break
                job = self._pending.popleft()
                batch.append(job)
                tokens += len(job.prompt)
        return batch

    def _take_short(self, free: int) -> list[_Job]:
        """Queued prompts of at most `prefill_overtake_tokens` tokens, oldest first, for `free`
        slots within the pass token budget: the ones that overtake a long pass."""
        s = self.settings
        batch: list[_Job] = []
        tokens = 0
        with self._lock:
            for job in list(self._pending):
                if len(batch) == free:
                    break
                n = len(job.prompt)
                if n <= s.prefill_overtake_tokens and tokens + n <= s.prefill_token_budget:
                    self._pending.remove(job)
                    batch.append(job)
                    tokens += n
        return batch

    def overtake(self, live: list[tuple[int, _Job]]) -> None:
        """Between two layer chunks of the pass over `live`: run the short prompts waiting (module
        doc) in the slots after its own, when that pass is long. Not nested, not under TP."""
        s = self.settings
        if self.group is not None or self._overtaking or not s.prefill_overtake_tokens:
            return
        if sum(len(job.prompt) for _, job in live) <= s.prefill_overtake_tokens:
            return
        first = max(slot for slot, _ in live) + 1
        batch = self._take_short(s.prefill_batch - first)
        if not batch:
            return
        self._overtaking = True
        try:
            self._run_guarded(batch, first)
        finally:
            self._overtaking = False

    def _drain(self) -> None:
        batch = self._take_batch()
        if batch:
            self._run_guarded(batch, 0)

    def _run_guarded(self, batch: list[_Job], first_slot: int) -> None:
        """`_run`, failing every job of the batch still open if the compute itself fails."""
        try:
            self._run(batch, first_slot)
        except BaseException as exc:  # the compute itself failed: every job still open fails with it
            if self.group is not None:  # the ranks may be anywhere in the pass: the instance restarts
                self._broken(exc)
                exc = InstanceBroken(f"prefill {self.settings.member_id}: {self.fatal}")
            for job in batch:
                if not job.settled:
                    self._fail(job, exc, True if job.pusher is None else self._quiesce(job.pusher))

    def _run(self, batch: list[_Job], first_slot: int = 0) -> None:
        """One pass over a batch, vLLM's save_kv_layer shape: open a pusher per prompt, compute
        layer chunk by chunk (each chunk pushed as soon as it is computed, `_ChunkPushes`), then
        sample each first token and send its kv_ready (`_finish`)."""
        started = time.perf_counter()
        for job in batch:
            self.metrics.observe_queue_wait(started - job.accepted)
        live = self._open_pushers(batch, first_slot)
        if not live:
            return
        if self.group is not None:  # the other ranks compute the same pass and push their heads
            self._last_collective = time.monotonic()
            self.group.broadcast(self._pass_plan(live))
        computed_pass = self._forward(live)
        if computed_pass is None:
            return  # every prompt of the pass ended before its last layer
        logits, cached = computed_pass
        if self.group is not None:
            self._merge_ranks(live, self.group.gather(None))
        computed = time.perf_counter()
        for row, (slot, job) in enumerate(live):
            if not job.settled:
                self._finish(job, logits[row], cached.get(slot, 0), len(live), started, computed)

    def _pass_plan(self, live: list[tuple[int, _Job]]) -> PassPlan:
        prompts = tuple(PassPrompt(j.request_id, slot, tuple(j.prompt), tuple(j.targets)) for slot, j in live)
        return PassPlan(prompts, self.settings.layers_per_chunk)

    def _merge_ranks(self, live: list[tuple[int, _Job]], reports: list[Any] | None) -> None:
        """The other ranks' outcomes: a prompt any rank failed fails here (before its notify),
        its push settled only if every rank's is."""
        per_rank: list[list[RankReport]] = (reports or [])[1:]
        for rank, rank_reports in enumerate(per_rank, start=1):
            for (_, job), report in zip(live, rank_reports, strict=True):
                self.metrics.observe_rank_bytes(rank, report.kv_bytes)
                job.peer_bytes += report.kv_bytes
                if report.pushed or job.settled:
                    continue
                assert job.pusher is not None
                self.metrics.observe_transfer_failure()
                settled = self._quiesce(job.pusher) and report.settled
                self._fail(job, PushError(report.error, job.targets[0]), settled)

    def _open_pushers(self, batch: list[_Job], first_slot: int) -> list[tuple[int, _Job]]:
        """(scratch slot, job) for every prompt still wanted whose targets can be reached."""
        s = self.settings
        live: list[tuple[int, _Job]] = []
        for slot, job in enumerate(batch, start=first_slot):
            if job.cancelled.is_set():
                self._fail(
                    job, PrefillCancelled(f"prefill of request {job.request_id} was cancelled while queued"), True
                )
                continue
            try:
                check_targets(self.engine, job.targets)
                job.pusher = KVPusher(
                    self.backend,
                    PushSource(self.pool.base_addr, self.cache.layout, slot=slot, heads=self.source.heads),
                    job.targets,
                    len(job.prompt),
                    queue_depth=s.queue_depth,
                    timeout_s=s.transfer_timeout_ms / 1000,
                    connect_timeout_ms=s.connect_timeout_ms,
                )
            except Exception as exc:  # this prompt's targets are unusable or unreachable: it alone fails
                self._fail(job, exc, True)  # nothing was put
                continue
            live.append((slot, job))
        return live

    def _forward(self, live: list[tuple[int, _Job]]) -> tuple[Any, dict[int, int]] | None:
        """The forward pass, each prompt after the longest prefix its cache holds: the logits of
        each prompt's last position and the tokens taken from the cache (None: all ended)."""
        # (tensor-parallel ranks compute in lockstep: the pass never stops early on rank 0 alone)
        on_chunk = _ChunkPushes(self, live, stop_early=self.group is None)
        uses: dict[int, PrefixUse] = {}
        final: list[Any] = []  # the final hidden states, when a prompt asks for its logprobs
        try:
            if self.prefix is not None:  # (a prompt that wants its logprobs computes every position)
                for slot, job in live:
                    if not job.echo:
                        uses[slot] = self.prefix.begin(job.prompt, self.cache, slot, job.cache_scope, job.prefetch)
            starts = [uses[slot].cached_tokens if slot in uses else 0 for slot, _ in live]
            work = PrefillPass(
                prompts=[job.prompt for _, job in live],
                slots=[slot for slot, _ in live],
                starts=starts,
                layers_per_chunk=self.settings.layers_per_chunk,
                on_chunk=on_chunk,
                on_final=final.append if any(job.echo for _, job in live) else None,
            )
            try:
                logits = self.engine.prefill(self.cache, work)
            except _AllEnded:
                return None
            _keep_prompt_states(live, starts, final)
            for slot, use in uses.items():  # the pass ran through: every prompt's KV is whole
                self.prefix.finish(use, self.cache, slot)
        finally:
            for use in uses.values():
                self.prefix.end(use)
        return logits, {slot: use.cached_tokens for slot, use in uses.items()}

    def _finish(self, job: _Job, logits: Any, cached: int, batch: int, started: float, computed: float) -> None:
        """Sample the prompt's first token and send kv_ready with it; resolve the job either way."""
        assert job.pusher is not None
        try:
            if job.cancelled.is_set():  # before the ready notify: nobody waits for it any more
                raise PrefillCancelled(f"prefill of request {job.request_id} was cancelled before its notify")
            stops = stop_token_ids(job.params, self.engine.tokenizer.eos_token_ids)
            drawn = draw_first(logits, job.params, job.prompt, job.num_generated, tuple(stops), self.engine.tokenizer)
            first = drawn.token
            ready: dict[str, Any] = {"first_token": first}
            if drawn.logprobs is not None:
                ready["first_logprobs"] = drawn.logprobs.to_wire()
            finish_ns = tracing.now_ns()
            stats = job.pusher.finish(ready)
            tracing.record(
                "kv.push.finish",
                finish_ns,
                tracing.now_ns(),
                {"pdserve.kv.bytes": stats.bytes, "pdserve.push.seconds": stats.seconds},
                parent=job.trace,
            )
        except PushError as exc:
            self.metrics.observe_transfer_failure()
            job.pusher.abort()
            self._fail(job, exc, False)
            return
        except Exception as exc:
            self._fail(job, exc, self._quiesce(job.pusher))
            return
        done = time.perf_counter()
        self.served += 1
        self.metrics.observe_rank_bytes(0, stats.bytes)
        kv_bytes = stats.bytes + job.peer_bytes  # (every rank's share)
        self.metrics.observe_prefilled(len(job.prompt), kv_bytes, stats.seconds, done - job.accepted)
        log.info(
            kv(
                event="prefill_done",
                request=job.request_id,
                tokens=len(job.prompt),
                cached=cached,
                targets=len(job.targets),
                batch=batch,
                kv_bytes=kv_bytes,
                queued_ms=round((started - job.accepted) * 1000, 1),
                compute_ms=round((computed - started) * 1000, 1),
                push_ms=round(stats.seconds * 1000, 1),
            )
        )
        self._resolve(
            job,
            PrefillResult(
                first,
                len(job.prompt),
                kv_bytes,
                stats.seconds,
                done - job.accepted,
                cached,
                self._prompt_logprobs(job),
            ),
        )

    def _prompt_logprobs(self, job: _Job) -> tuple[TokenLogprobs, ...]:
        """The prompt's logprobs, from the states its pass kept (none unless it asked)."""
        states, job.prompt_states = job.prompt_states, None
        if states is None or job.params is None or job.params.prompt_logprobs is None:
            return ()
        return self.engine.prompt_logprobs(states, job.prompt, job.params.prompt_logprobs)

    def _fail(self, job: _Job, exc: BaseException, settled: bool) -> None:
        self._resolve(job, _mark(exc, settled))

    @staticmethod
    def _resolve(job: _Job, outcome: PrefillResult | BaseException) -> None:
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

    @staticmethod
    def _quiesce(pusher: KVPusher) -> bool:
        """After a failure that was not the transfer's: wait for the puts already issued (bounded
        by the transfer timeout), then drop the push. True if none of them can still land."""
        try:
            pusher.flush()
            settled = True
        except (PushError, RuntimeError):
            settled = False
        pusher.abort()
        return settled


class _ChunkPushes:
    """The `on_chunk` of one pass: after each chunk of layers, record its compute and push it for
    every prompt still live; raise `_AllEnded` once none is (the pass stops early)."""

    def __init__(self, worker: PrefillWorker, live: list[tuple[int, _Job]], stop_early: bool = True) -> None:
        self.worker, self.live, self.stop_early = worker, live, stop_early
        self.started_ns = tracing.now_ns()

    def __call__(self, layers: range) -> None:
        computed_ns = tracing.now_ns()
        for _, job in self.live:
            if not job.settled:
                self._push(job, layers, computed_ns)
        if self.stop_early and all(job.settled for _, job in self.live):
            raise _AllEnded
        self.worker.overtake(self.live)  # (this chunk's puts are issued: they land meanwhile)
        self.started_ns = tracing.now_ns()

    def _push(self, job: _Job, layers: range, computed_ns: int) -> None:
        worker = self.worker
        assert job.pusher is not None
        span = {"pdserve.layers.first": layers.start, "pdserve.layers.count": len(layers)}
        tracing.record(
            "prefill.compute", self.started_ns, computed_ns, {**span, "pdserve.batch": len(self.live)}, parent=job.trace
        )
        if job.cancelled.is_set():
            worker._fail(
                job,
                PrefillCancelled(f"prefill of request {job.request_id} was cancelled at layer {layers.start}"),
                worker._quiesce(job.pusher),
            )
            return
        push_ns = tracing.now_ns()
        try:
            job.pusher.push_chunk(layers)
        except PushError as exc:  # a put failed: whether others still land is unknown
            worker.metrics.observe_transfer_failure()
            job.pusher.abort()
            worker._fail(job, exc, False)
        tracing.record(
            "kv.push",
            push_ns,
            tracing.now_ns(),
            {**span, "pdserve.push.targets": len(job.targets), "pdserve.push.failed": job.settled},
            parent=job.trace,
        )
