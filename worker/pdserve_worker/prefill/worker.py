"""The prefill role: compute a prompt's KV layer chunk by layer chunk, pushing each chunk as it is done.

A pass (prefill/pass_run.py) runs `engine.prefill(cache, PrefillPass(..., on_chunk=...))`,
which writes each layer chunk's KV into a scratch pool registered with the transfer engine, and
the prompt's pusher puts that chunk at once, so the transfer of chunk k overlaps the compute of chunk k+1. The first token is sampled
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
from typing import Any

from pdserve_common.logs import kv
from pdserve_common.membership import EventType, Load, MemberEvent, MemberInfo, Role
from pdserve_worker.engines.base import Engine
from pdserve_worker.kv.prefix_store import PrefixStoreConfig, open_prefix_store
from pdserve_worker.kv.slots import Grant
from pdserve_worker.model.sampling.params import SamplingParams
from pdserve_worker.prefill.jobs import (
    InstanceBroken,
    Job,
    JobKey,
    PrefillCancelled,
    PrefillResult,
    fail,
    mark,
    quiesce,
)
from pdserve_worker.prefill.pass_run import Live, PassRun
from pdserve_worker.ranks.group import TPGroup
from pdserve_worker.ranks.prefill import IDLE, STOP, pushed_heads, scratch_layout
from pdserve_worker.rpc.broker_client import BrokerClient
from pdserve_worker.serving.costs import CostMeter
from pdserve_worker.serving.settings import WorkerSettings
from pdserve_worker.serving.worker_metrics import WorkerMetrics
from pdserve_worker.transfer.base import TransferBackend
from pdserve_worker.transfer.pool import KVPool
from pdserve_worker.transfer.push import PushSource

log = logging.getLogger(__name__)

# A Cancel that arrives before its Prefill is remembered this long, for at most this many ids.
CANCEL_MEMORY_S = 60.0
CANCEL_MEMORY_MAX = 4096


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
        self.last_collective = time.monotonic()
        self._heartbeat: asyncio.Task[None] | None = None
        # One scratch slot per prompt of a pass (a tensor-parallel rank's: its KV heads only).
        layout = scratch_layout(settings, engine)
        self.pool = KVPool(backend, layout, device=settings.device)
        self.cache = engine.bind_pool(layout, self.pool.tensor)
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
        self._pending: deque[Job] = deque()
        self._overtaking = False  # a short pass runs inside a long one's (compute thread only)
        self._lock = threading.Lock()
        self.queued = 0  # requests accepted and not yet answered
        self.draining = False  # set by drain(): new prompts are refused
        self.served = 0
        self.costs = CostMeter()  # prompt tokens per second of its passes, reported for the router's choice
        self._jobs: dict[JobKey, Job] = {}
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
            if time.monotonic() - self.last_collective > period and not self.queued:
                self._compute.submit(self._tell_ranks, IDLE)

    def _tell_ranks(self, what: str) -> None:
        """(compute thread) IDLE or STOP to the other ranks, unless a pass just spoke to them."""
        if self.group is None or self.fatal is not None:
            return
        if what == IDLE and time.monotonic() - self.last_collective < self.group.spec.timeout_s / 8:
            return
        try:
            self.group.broadcast(what)
            self.last_collective = time.monotonic()
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
        """Reported with each keepalive: requests queued or computing here (routers rank by it),
        and the rate of its passes (router/disaggregation.py)."""
        return Load(active_requests=self.queued, prefill_tokens_per_s=self.costs.prefill_tokens_per_s)

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
            raise mark(InstanceBroken(f"prefill {self.settings.member_id}: {self.fatal}"), True)
        if self._early_cancels.pop(key, 0.0) > time.monotonic():
            raise mark(PrefillCancelled(f"prefill of request {request_id} was cancelled before it arrived"), True)
        loop = asyncio.get_running_loop()
        job = self._jobs[key] = Job(
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

    def _take_batch(self) -> list[Job]:
        """The waiting jobs of the next pass: up to `prefill_batch`, within `prefill_token_budget`."""
        s = self.settings
        batch: list[Job] = []
        tokens = 0
        with self._lock:
            while self._pending and len(batch) < s.prefill_batch:
                if batch and tokens + len(self._pending[0].prompt) > s.prefill_token_budget:
                    break
                job = self._pending.popleft()
                batch.append(job)
                tokens += len(job.prompt)
        return batch

    def _take_short(self, free: int) -> list[Job]:
        """Queued prompts of at most `prefill_overtake_tokens` tokens, oldest first, for `free`
        slots within the pass token budget: the ones that overtake a long pass."""
        s = self.settings
        batch: list[Job] = []
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

    def overtake(self, live: Live) -> None:
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

    def _run_guarded(self, batch: list[Job], first_slot: int) -> None:
        """A `PassRun` of the batch, failing every job still open if the compute itself fails."""
        try:
            PassRun(self, batch, first_slot).run()
        except BaseException as exc:  # the compute itself failed: every job still open fails with it
            if self.group is not None:  # the ranks may be anywhere in the pass: the instance restarts
                self._broken(exc)
                exc = InstanceBroken(f"prefill {self.settings.member_id}: {self.fatal}")
            for job in batch:
                if not job.settled:
                    fail(job, exc, True if job.pusher is None else quiesce(job.pusher))
