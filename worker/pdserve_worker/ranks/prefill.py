"""A tensor-parallel prefill instance: rank 0 describes each pass, every rank computes it and
pushes its own KV heads straight into the decode's blocks (seed 002: AllReduce inside the
instance, the KV one-sided through the transfer engine, the two paths separate and concurrent).

Rank 0 is the `PrefillWorker` routers see. It broadcasts each pass (`PassPlan`) to the other
ranks (`FollowerRank`), every rank runs the same forward and pushes its heads of each layer
chunk from its own pool; each rank reports its puts (`RankReport`) and rank 0 sends a prompt's
ready notify only once every rank's landed. A prompt that fails on any rank fails; the prefix
cache is off. Rank 0 broadcasts `IDLE` while idle and `STOP` on a clean stop; a failed
collective ends the instance, which restarts as one. The full account: docs/roles.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from pdserve_common.logs import kv
from pdserve_worker.engines.base import Engine, PrefillPass
from pdserve_worker.kv.cache import KVCache
from pdserve_worker.kv.slots import Grant
from pdserve_worker.ranks.group import IDLE, STOP, TPGroup
from pdserve_worker.serving.settings import WorkerSettings
from pdserve_worker.transfer.base import TransferBackend
from pdserve_worker.transfer.pool import KVPool
from pdserve_worker.transfer.push import KVPusher, PushError, PushSource

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PassPrompt:
    """One prompt of a pass: its scratch slot, tokens, and where its KV goes."""

    request_id: str
    slot: int
    prompt: tuple[int, ...]
    targets: tuple[Grant, ...]


@dataclass(frozen=True)
class PassPlan:
    """What rank 0 tells the others before a pass."""

    prompts: tuple[PassPrompt, ...]
    layers_per_chunk: int


@dataclass(frozen=True)
class RankReport:
    """One rank's outcome for one prompt of a pass."""

    request_id: str
    pushed: bool  # every put of this rank landed
    settled: bool  # none of this rank's puts can still land
    kv_bytes: int = 0
    error: str = ""


def scratch_layout(settings: WorkerSettings, engine: Engine) -> Any:
    """A prefill's scratch pool: one slot per prompt of a pass, holding this rank's KV heads."""
    first_head = engine.tp.kv_heads.start if engine.tp is not None else 0
    return engine.kv_layout(settings.prefill_batch, settings.max_length, settings.model_dtype, first_head=first_head)


def pushed_heads(engine: Engine) -> range | None:
    """The KV heads this rank pushes (None: all it holds)."""
    return engine.tp.pushed_kv_heads if engine.tp is not None else None


def check_targets(engine: Engine, targets: list[Grant]) -> None:
    """Each target holds KV heads of this model: its head range lies within the model's (a
    rank only sees its share, so the instance checks the whole range once, on rank 0)."""
    if engine.tp is None:
        return
    heads = range(engine.tp.config.num_kv_heads)
    for t in targets:
        held = t.layout.head_range
        if held.start < heads.start or held.stop > heads.stop or not held:
            raise ValueError(f"target {t.describe()} holds KV heads {held}, the model has {heads}")


def run_forward(engine: Engine, cache: KVCache, plan: PassPlan, on_chunk: Any) -> Any:
    """A follower rank's forward of the pass: rank 0's call with no head (so collectives match)."""
    prompts = plan.prompts
    work = PrefillPass(
        prompts=[p.prompt for p in prompts],
        slots=[p.slot for p in prompts],
        starts=[0] * len(prompts),
        layers_per_chunk=plan.layers_per_chunk,
        on_chunk=on_chunk,
        logits=False,
    )
    return engine.prefill(cache, work)


class FollowerRank:
    """Rank 1.. of a tensor-parallel prefill: its scratch pool, and the passes rank 0 describes."""

    def __init__(self, settings: WorkerSettings, engine: Engine, backend: TransferBackend, group: TPGroup) -> None:
        self.settings, self.engine, self.backend, self.group = settings, engine, backend, group
        layout = scratch_layout(settings, engine)
        self.pool = KVPool(backend, layout, device=settings.device)
        self.cache = engine.bind_pool(layout, self.pool.tensor)
        self.heads = pushed_heads(engine)

    def serve(self) -> None:
        """Run rank 0's passes until it says STOP (a failed collective raises GroupError)."""
        passes = 0
        while True:
            plan = self.group.broadcast()
            if plan == STOP:
                log.info(kv(event="tp_rank_stopped", rank=self.group.rank, passes=passes))
                return
            if plan == IDLE:
                continue
            self.group.gather(self.run_pass(plan))
            passes += 1

    def run_pass(self, plan: PassPlan) -> list[RankReport]:
        """Compute the pass, pushing this rank's heads of each chunk; every prompt's report."""
        pushers: dict[str, KVPusher | None] = {}
        errors: dict[str, tuple[str, bool]] = {}  # request -> (error, settled)
        for p in plan.prompts:
            pushers[p.request_id] = self._open(p, errors)

        def on_chunk(layers: range) -> None:
            for request_id, pusher in pushers.items():
                if pusher is None or request_id in errors:
                    continue
                try:
                    pusher.push_chunk(layers)
                except PushError as exc:
                    pusher.abort()
                    errors[request_id] = (str(exc), False)

        try:
            run_forward(self.engine, self.cache, plan, on_chunk)
        except BaseException:
            for pusher in pushers.values():
                if pusher is not None:
                    pusher.abort()
            raise
        return [self._settle(p.request_id, pushers[p.request_id], errors) for p in plan.prompts]

    def _open(self, p: PassPrompt, errors: dict[str, tuple[str, bool]]) -> KVPusher | None:
        if self.heads is not None and not self.heads:
            return None  # a replica of heads another rank pushes
        s = self.settings
        try:
            return KVPusher(
                self.backend,
                PushSource(self.pool.base_addr, self.cache.layout, slot=p.slot, heads=self.heads),
                p.targets,
                len(p.prompt),
                queue_depth=s.queue_depth,
                timeout_s=s.transfer_timeout_ms / 1000,
                connect_timeout_ms=s.connect_timeout_ms,
            )
        except (PushError, ValueError) as exc:
            errors[p.request_id] = (f"rank {self.group.rank}: {exc}", True)  # nothing was put
            return None

    def _settle(self, request_id: str, pusher: KVPusher | None, errors: dict[str, tuple[str, bool]]) -> RankReport:
        if request_id in errors:
            error, settled = errors[request_id]
            return RankReport(request_id, False, settled, error=error)
        if pusher is None:
            return RankReport(request_id, True, True)
        try:
            stats = pusher.settle()
        except PushError as exc:
            pusher.abort()
            return RankReport(request_id, False, False, error=f"rank {self.group.rank}: {exc}")
        return RankReport(request_id, True, True, stats.bytes)

    def close(self) -> None:
        self.pool.deregister()

    def free(self) -> None:
        self.pool.free()
