"""One prefill pass over a batch of queued prompts, vLLM's save_kv_layer shape: open a pusher per
prompt, compute layer chunk by chunk (each chunk pushed as soon as it is computed), then sample
each first token and send its kv_ready once every put landed. A prompt that fails or is
cancelled ends alone; the pass stops early once none is left (unless tensor-parallel ranks run
it in lockstep). `PassRun` owns the pass's state; the worker that runs it is its `PassHost`.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

from pdserve_common import tracing
from pdserve_common.logs import kv
from pdserve_worker.engines.base import Engine, PrefillPass
from pdserve_worker.kv.cache import KVCache
from pdserve_worker.kv.prefix_store import PrefixStore, PrefixUse
from pdserve_worker.model.sampling.params import TokenLogprobs
from pdserve_worker.model.sampling.sampler import draw_first, stop_token_ids
from pdserve_worker.prefill.jobs import Job, PrefillCancelled, PrefillResult, fail, quiesce, resolve
from pdserve_worker.ranks.group import TPGroup
from pdserve_worker.ranks.prefill import PassPlan, PassPrompt, RankReport, check_targets
from pdserve_worker.serving.costs import CostMeter
from pdserve_worker.serving.settings import WorkerSettings
from pdserve_worker.serving.worker_metrics import WorkerMetrics
from pdserve_worker.transfer.base import TransferBackend
from pdserve_worker.transfer.pool import KVPool
from pdserve_worker.transfer.push import KVPusher, PushError, PushSource

log = logging.getLogger(__name__)

Live = list[tuple[int, Job]]  # (scratch slot, job) of each prompt a pass computes


class _AllEnded(Exception):
    """Every prompt of a pass has ended (failed or cancelled): stop computing it."""


class PassHost(Protocol):
    """What a pass reads from the prefill worker that runs it (prefill/worker.PrefillWorker)."""

    settings: WorkerSettings
    engine: Engine
    backend: TransferBackend
    pool: KVPool
    cache: KVCache
    source: PushSource
    prefix: PrefixStore | None
    metrics: WorkerMetrics
    group: TPGroup | None
    served: int
    last_collective: float
    costs: CostMeter

    def overtake(self, live: Live) -> None: ...


def keep_prompt_states(live: Live, starts: list[int], final: list[Any]) -> None:
    """Hand each prompt that asks for its logprobs its rows of the pass's packed final states."""
    if not final:
        return
    offset = 0
    for (_, job), start in zip(live, starts, strict=True):
        length = len(job.prompt) - start
        if job.echo:
            job.prompt_states = final[0][offset : offset + length]
        offset += length


class PassRun:
    """One pass over `batch`, in the scratch slots from `first_slot` on; `run` it on the compute
    thread. Its own `on_chunk`: after each chunk of layers, record the compute and push the chunk
    for every prompt still live; raise `_AllEnded` once none is (when it may stop early)."""

    def __init__(self, host: PassHost, batch: list[Job], first_slot: int = 0) -> None:
        self.host, self.batch, self.first_slot = host, batch, first_slot
        self.live: Live = []
        # (tensor-parallel ranks compute in lockstep: the pass never stops early on rank 0 alone)
        self.stop_early = host.group is None
        self.started_ns = 0

    def run(self) -> None:
        """Open the pushers, compute, merge the other ranks' outcomes, finish each prompt."""
        host = self.host
        started = time.perf_counter()
        for job in self.batch:
            host.metrics.observe_queue_wait(started - job.accepted)
        self.live = live = self._open_pushers()
        if not live:
            return
        if host.group is not None:  # the other ranks compute the same pass and push their heads
            host.last_collective = time.monotonic()
            host.group.broadcast(self._plan())
        computed_pass = self._forward()
        if computed_pass is None:
            return  # every prompt of the pass ended before its last layer
        logits, cached = computed_pass
        if host.group is not None:
            self._merge_ranks(host.group.gather(None))
        computed = time.perf_counter()
        host.costs.prefilled(sum(len(job.prompt) - cached.get(slot, 0) for slot, job in live), computed - started)
        for row, (slot, job) in enumerate(live):
            if not job.settled:
                self._finish(job, logits[row], cached.get(slot, 0), started, computed)

    def _plan(self) -> PassPlan:
        prompts = tuple(PassPrompt(j.request_id, slot, tuple(j.prompt), tuple(j.targets)) for slot, j in self.live)
        return PassPlan(prompts, self.host.settings.layers_per_chunk)

    def _merge_ranks(self, reports: list[Any] | None) -> None:
        """The other ranks' outcomes: a prompt any rank failed fails here (before its notify),
        its push settled only if every rank's is."""
        metrics = self.host.metrics
        per_rank: list[list[RankReport]] = (reports or [])[1:]
        for rank, rank_reports in enumerate(per_rank, start=1):
            for (_, job), report in zip(self.live, rank_reports, strict=True):
                metrics.observe_rank_bytes(rank, report.kv_bytes)
                job.peer_bytes += report.kv_bytes
                if report.pushed or job.settled:
                    continue
                assert job.pusher is not None
                metrics.observe_transfer_failure()
                settled = quiesce(job.pusher) and report.settled
                fail(job, PushError(report.error, job.targets[0]), settled)

    def _open_pushers(self) -> Live:
        """(scratch slot, job) for every prompt still wanted whose targets can be reached."""
        host = self.host
        s = host.settings
        live: Live = []
        for slot, job in enumerate(self.batch, start=self.first_slot):
            if job.cancelled.is_set():
                fail(job, PrefillCancelled(f"prefill of request {job.request_id} was cancelled while queued"), True)
                continue
            try:
                check_targets(host.engine, job.targets)
                job.pusher = KVPusher(
                    host.backend,
                    PushSource(host.pool.base_addr, host.cache.layout, slot=slot, heads=host.source.heads),
                    job.targets,
                    len(job.prompt),
                    queue_depth=s.queue_depth,
                    timeout_s=s.transfer_timeout_ms / 1000,
                    connect_timeout_ms=s.connect_timeout_ms,
                )
            except Exception as exc:  # this prompt's targets are unusable or unreachable: it alone fails
                fail(job, exc, True)  # nothing was put
                continue
            live.append((slot, job))
        return live

    def _forward(self) -> tuple[Any, dict[int, int]] | None:
        """The forward pass, each prompt after the longest prefix its cache holds: the logits of
        each prompt's last position and the tokens taken from the cache (None: all ended)."""
        host, live, prefix = self.host, self.live, self.host.prefix
        self.started_ns = tracing.now_ns()
        uses: dict[int, PrefixUse] = {}
        final: list[Any] = []  # the final hidden states, when a prompt asks for its logprobs
        try:
            if prefix is not None:  # (a prompt that wants its logprobs computes every position)
                for slot, job in live:
                    if not job.echo:
                        uses[slot] = prefix.begin(job.prompt, host.cache, slot, job.cache_scope, job.prefetch)
            starts = [uses[slot].cached_tokens if slot in uses else 0 for slot, _ in live]
            work = PrefillPass(
                prompts=[job.prompt for _, job in live],
                slots=[slot for slot, _ in live],
                starts=starts,
                layers_per_chunk=host.settings.layers_per_chunk,
                on_chunk=self,
                on_final=final.append if any(job.echo for _, job in live) else None,
            )
            try:
                logits = host.engine.prefill(host.cache, work)
            except _AllEnded:
                return None
            keep_prompt_states(live, starts, final)
            for slot, use in uses.items():  # the pass ran through: every prompt's KV is whole
                prefix.finish(use, host.cache, slot)  # type: ignore[union-attr]
        finally:
            for use in uses.values():
                prefix.end(use)  # type: ignore[union-attr]
        return logits, {slot: use.cached_tokens for slot, use in uses.items()}

    def __call__(self, layers: range) -> None:
        """The pass's `on_chunk`: push the chunk just computed for every prompt still live."""
        computed_ns = tracing.now_ns()
        for _, job in self.live:
            if not job.settled:
                self._push(job, layers, computed_ns)
        if self.stop_early and all(job.settled for _, job in self.live):
            raise _AllEnded
        self.host.overtake(self.live)  # (this chunk's puts are issued: they land meanwhile)
        self.started_ns = tracing.now_ns()

    def _push(self, job: Job, layers: range, computed_ns: int) -> None:
        assert job.pusher is not None
        span = {"pdserve.layers.first": layers.start, "pdserve.layers.count": len(layers)}
        tracing.record(
            "prefill.compute", self.started_ns, computed_ns, {**span, "pdserve.batch": len(self.live)}, parent=job.trace
        )
        if job.cancelled.is_set():
            fail(
                job,
                PrefillCancelled(f"prefill of request {job.request_id} was cancelled at layer {layers.start}"),
                quiesce(job.pusher),
            )
            return
        push_ns = tracing.now_ns()
        try:
            job.pusher.push_chunk(layers)
        except PushError as exc:  # a put failed: whether others still land is unknown
            self.host.metrics.observe_transfer_failure()
            job.pusher.abort()
            fail(job, exc, False)
        tracing.record(
            "kv.push",
            push_ns,
            tracing.now_ns(),
            {**span, "pdserve.push.targets": len(job.targets), "pdserve.push.failed": job.settled},
            parent=job.trace,
        )

    def _finish(self, job: Job, logits: Any, cached: int, started: float, computed: float) -> None:
        """Sample the prompt's first token and send kv_ready with it; resolve the job either way."""
        host = self.host
        assert job.pusher is not None
        try:
            if job.cancelled.is_set():  # before the ready notify: nobody waits for it any more
                raise PrefillCancelled(f"prefill of request {job.request_id} was cancelled before its notify")
            stops = stop_token_ids(job.params, host.engine.tokenizer.eos_token_ids)
            drawn = draw_first(logits, job.params, job.prompt, job.num_generated, tuple(stops), host.engine.tokenizer)
            ready: dict[str, Any] = {"first_token": drawn.token}
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
            host.metrics.observe_transfer_failure()
            job.pusher.abort()
            fail(job, exc, False)
            return
        except Exception as exc:
            fail(job, exc, quiesce(job.pusher))
            return
        done = time.perf_counter()
        host.served += 1
        host.metrics.observe_rank_bytes(0, stats.bytes)
        kv_bytes = stats.bytes + job.peer_bytes  # (every rank's share)
        host.metrics.observe_prefilled(len(job.prompt), kv_bytes, stats.seconds, done - job.accepted)
        log.info(
            kv(
                event="prefill_done",
                request=job.request_id,
                tokens=len(job.prompt),
                cached=cached,
                targets=len(job.targets),
                batch=len(self.live),
                kv_bytes=kv_bytes,
                queued_ms=round((started - job.accepted) * 1000, 1),
                compute_ms=round((computed - started) * 1000, 1),
                push_ms=round(stats.seconds * 1000, 1),
            )
        )
        result = PrefillResult(
            drawn.token,
            len(job.prompt),
            kv_bytes,
            stats.seconds,
            done - job.accepted,
            cached,
            self._prompt_logprobs(job),
        )
        resolve(job, result)

    def _prompt_logprobs(self, job: Job) -> tuple[TokenLogprobs, ...]:
        """The prompt's logprobs, from the states its pass kept (none unless it asked)."""
        states, job.prompt_states = job.prompt_states, None
        if states is None or job.params is None or job.params.prompt_logprobs is None:
            return ()
        return self.host.engine.prompt_logprobs(states, job.prompt, job.params.prompt_logprobs)
