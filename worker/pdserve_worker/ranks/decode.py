"""A tensor-parallel decode instance: rank 0 decodes, ranks 1.. run the same steps on their heads.

Rank 0 is the decode routers and the broker see: the slot table, the write leases, the ready
notifications, the batch and the sampler are its alone. Every rank holds its share of the
model and a paged pool of its KV heads with rank 0's blocks; a grant becomes one grant per
rank, so a prefill pushes each rank's heads straight into that rank's pool. Each step rank 0
sends the step on the group's CPU channel and every rank runs `decode_step`; a failed or
timed-out collective ends rank 0's process so the instance restarts as one. Rank 0 grants and
ends each lease on every rank over the lease channel (`RankLeases`); a drain has every rank
push its own heads (`PushOrder`). The full account: docs/roles.md.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from pdserve_common.kv_layout import KVLayout
from pdserve_common.logs import kv
from pdserve_worker.engines.base import TENSOR_PARALLEL, Engine, group_engine
from pdserve_worker.kv.paged import PagedKVCache
from pdserve_worker.kv.slots import Grant
from pdserve_worker.model.engine import Generator
from pdserve_worker.ranks.group import IDLE, STOP, GroupError, MemberUnavailable, TPGroup
from pdserve_worker.serving.settings import WorkerSettings
from pdserve_worker.transfer.base import TransferBackend, TransferError
from pdserve_worker.transfer.leases import BlockWriteLeases
from pdserve_worker.transfer.pool import KVPool
from pdserve_worker.transfer.push import KVPusher

log = logging.getLogger(__name__)

IDLE_EVERY_S = 5.0  # well inside the group's deadline (tp_timeout_seconds, 60 by default)
DRAIN_EVERY_S = 0.05  # how often a follower empties its notify queue


@dataclass(frozen=True)
class DecodeStep:
    """One decode step as rank 0 runs it: what the other ranks need to run the same one."""

    slots: tuple[int, ...]
    positions: tuple[int, ...]
    tokens: tuple[int, ...]
    tables: tuple[tuple[int, ...], ...]  # each slot's blocks, in token order


@dataclass(frozen=True)
class RankPool:
    """Where a rank's KV pool is: the grant of a reservation names it for that rank."""

    engine_id: str
    base_addr: int
    layout: dict[str, Any]


def first_head(engine: Engine) -> int:
    return engine.tp.kv_heads.start if engine.tp is not None else 0


class MirroredModel:
    """Rank 0's engine (any `model.engine.Decoder`): every decode step is first described to the other ranks."""

    def __init__(self, model: Any, group: TPGroup) -> None:
        self._model, self._group = model, group
        self._last_sent = time.monotonic()
        self.broken = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def decode_step(
        self, cache: PagedKVCache, slots: Sequence[int], positions: Sequence[int], token_ids: Sequence[int]
    ) -> torch.Tensor:
        tables = tuple(cache.table(s) for s in slots)
        self._send(DecodeStep(tuple(slots), tuple(positions), tuple(token_ids), tables))
        try:
            return self._model.decode_step(cache, slots, positions, token_ids)
        except BaseException as exc:  # the ranks may be anywhere in the step: the instance restarts
            self._broken(exc)
            raise

    def idle(self) -> None:
        """Keep the other ranks' wait alive (called by the generation loop while it has no work)."""
        if time.monotonic() - self._last_sent >= IDLE_EVERY_S:
            self._send(IDLE)

    def _send(self, what: Any) -> None:
        if self.broken:
            raise GroupError("tensor-parallel decode group is broken: the instance is restarting")
        try:
            self._group.broadcast(what)
        except GroupError as exc:
            self._broken(exc)
            raise
        self._last_sent = time.monotonic()

    def _broken(self, exc: BaseException) -> None:
        """A rank is gone: this instance cannot decode any more; end it so it restarts as one."""
        if not self.broken:
            self.broken = True
            log.error(kv(event="tp_group_broken", role="decode", error=str(exc)[:300]))
            os.kill(os.getpid(), signal.SIGTERM)


GRANT, END, PUSH = "grant", "end", "push"  # the lease channel's messages, besides IDLE and STOP


@dataclass(frozen=True)
class PushOrder:
    """A handed-over request's KV, as each rank pushes its heads of it (the lease channel's PUSH)."""

    slot: int
    generation: int
    blocks: tuple[int, ...]
    num_tokens: int
    targets: tuple[Grant, ...]
    timeout_s: float
    layers_per_chunk: int


class RankPushes:
    """The other ranks' pushes of one handed-over request (`decode.group_hooks.MemberPushes`): sent
    on the lease channel by a thread of its own, which holds the channel until every rank
    answered (no grant can come between: the decode is draining)."""

    def __init__(self, leases: RankLeases, order: PushOrder) -> None:
        self._answers: list[Any] = []
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(leases, order), name="tp-push", daemon=True)
        self._thread.start()

    def _run(self, leases: RankLeases, order: PushOrder) -> None:
        try:
            self._answers = leases.push(order)
        except BaseException as exc:  # (reported by wait)
            self._error = exc

    def wait(self) -> int:
        """The other ranks' bytes, once every one of them landed its heads."""
        self._thread.join()
        if self._error is not None:
            raise MemberUnavailable(f"tensor-parallel ranks did not push their heads: {self._error}")
        failed = [(rank, a) for rank, a in enumerate(self._answers, start=1) if not isinstance(a, int)]
        if failed:
            rank, why = failed[0]
            raise MemberUnavailable(f"tensor-parallel rank {rank} did not push its heads: {why}")
        return sum(self._answers)

    def settle(self) -> None:
        self._thread.join()


class RankLeases:
    """Rank 0's write-lease hooks for every rank (its `BlockTable`'s `leases`): its own engine's,
    then each other rank's over the group's lease channel. A grant returns only once every rank
    acknowledged its lease — the prefill's puts into a rank's pool can then never arrive first;
    a rank that refuses fails the grant (nobody keeps a lease of it). While no lease changes,
    IDLE goes out every IDLE_EVERY_S so the others' wait stays inside the group's deadline.
    The lock keeps the channel's messages in one order across the threads that send them."""

    def __init__(self, own: BlockWriteLeases, group: TPGroup) -> None:
        self.own, self.group = own, group
        self._lock = threading.Lock()
        self._last_sent = time.monotonic()
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._keep_alive, name="tp-lease-idle", daemon=True)
        self._ticker.start()

    def granted(self, slot: int, generation: int, blocks: Sequence[int]) -> None:
        self.own.granted(slot, generation, blocks)
        with self._lock:
            try:
                self._send((GRANT, slot, generation, tuple(blocks)))
                refused = [a for a in (self.group.lease_gather(None) or [])[1:] if a]
                if refused:
                    self._send((END, slot, generation))  # the ranks that took it give it back
            except GroupError:
                self.own.ended(slot, generation)
                raise
        if refused:
            self.own.ended(slot, generation)
            raise RuntimeError(f"a tensor-parallel rank refused the write lease of slot {slot}: {refused[0]}")

    def ended(self, slot: int, generation: int) -> None:
        self.own.ended(slot, generation)
        with self._lock:
            self._send((END, slot, generation))

    def push(self, order: PushOrder) -> list[Any]:
        """Every other rank pushes its heads of a handed-over request; each answers its bytes
        (an int) or why it could not (a str). Blocks until they all answered."""
        with self._lock:
            self._send((PUSH, order.slot, order.generation, order))
            return (self.group.lease_gather(None) or [])[1:]

    def __len__(self) -> int:
        return len(self.own)

    def close(self) -> None:
        """STOP the other ranks' lease threads (no grant is in flight: the server has stopped)."""
        self._stop.set()
        with self._lock:
            try:
                self._send(STOP)
            except GroupError as exc:
                log.warning(kv(event="tp_lease_stop_unsent", error=str(exc)[:200]))

    def _send(self, message: Any) -> None:
        self.group.lease_broadcast(message)
        self._last_sent = time.monotonic()

    def _keep_alive(self) -> None:
        while not self._stop.wait(1.0):
            with self._lock:
                if self._stop.is_set() or time.monotonic() - self._last_sent < IDLE_EVERY_S:
                    continue
                try:
                    self._send(IDLE)
                except GroupError:
                    return  # (the step loop finds the group broken too, and ends the instance)


def serve_leases(
    group: TPGroup, leases: BlockWriteLeases, push: Callable[[PushOrder], int | str] | None = None
) -> None:
    """A rank past 0: apply rank 0's lease messages to this rank's engine until STOP, answering
    each grant (None, or why the engine refused it) and each PUSH (`push`'s answer)."""
    while True:
        try:
            message = group.lease_broadcast()
        except GroupError:
            return  # rank 0 is gone: the step loop ends this rank
        if message == STOP:
            return
        if message == IDLE:
            continue
        kind, slot, generation, *rest = message
        if kind == END:
            leases.ended(slot, generation)
            continue
        answer: int | str | None = None
        if kind == PUSH:
            answer = push(rest[0]) if push is not None else "this rank does not push"
        else:
            try:
                leases.granted(slot, generation, rest[0])
            except RuntimeError as exc:
                answer = str(exc)
        try:
            group.lease_gather(answer)
        except GroupError:
            return


class TPGenerator(Generator[Any]):
    """The continuous batch over a mirrored model; idle ticks reach the other ranks."""

    ticks_when_idle = True

    def idle(self) -> None:
        self.model.idle()


class TPDecodeGroup:
    """Rank 0's side (`decode.group_hooks.GroupHooks`): the pools of every rank, their grants, the
    mirrored decode step."""

    def __init__(
        self, settings: WorkerSettings, engine: Engine, group: TPGroup, paged: Callable[[KVLayout], KVLayout]
    ) -> None:
        # `paged`: the decode's own pool of a layout (decode/worker.decode_pool_layout; passed in,
        # as this package sits below the roles)
        self.settings, self.group, self.paged = settings, group, paged
        self.engine = group_engine(engine, TENSOR_PARALLEL)
        self.others: list[RankPool] = []
        self.model: MirroredModel | None = None
        self.leases: RankLeases | None = None

    def pool_layout(self, full: KVLayout) -> KVLayout:
        """Rank 0's paged pool; the others make theirs with the same blocks and tell where."""
        if not self.settings.kv_block_tokens:
            raise ValueError("a tensor-parallel decode needs a paged KV pool (kv_block_tokens > 0)")
        layout = self.paged(replace(full, first_head=first_head(self.engine)))
        self.group.broadcast(layout.to_dict())
        pools = self.group.gather(None) or []
        self.others = [RankPool(**p) for p in pools[1:]]
        log.info(kv(event="tp_decode_pools", ranks=self.group.size, blocks=layout.num_blocks))
        return layout

    def generator(self, engine: Engine, cache: Any) -> Generator[Any]:
        self.model = MirroredModel(self.engine, self.group)  # (the engine the group was made with)
        return TPGenerator(self.model, engine.tokenizer, cache)  # type: ignore[arg-type]

    def grants(self, grant: Grant) -> list[Grant]:
        return [
            grant,
            *(
                replace(grant, engine_id=p.engine_id, base_addr=p.base_addr, layout=KVLayout.from_dict(p.layout))
                for p in self.others
            ),
        ]

    async def wait_ready(self, slot: int, generation: int, timeout_s: float) -> list[tuple[int, int]]:
        return []  # (rank 0's notify comes after every rank's puts completed: module doc)

    def labels(self) -> dict[str, str]:
        return {"tensor_parallel": str(self.group.size)}

    migrates = True  # each rank pushes its heads of a handed-over request (module doc)

    def push_members(
        self,
        slot: int,
        generation: int,
        nonce: str,
        num_tokens: int,
        targets: Sequence[Grant],
        timeout_s: float,
        blocks: Sequence[int] = (),
    ) -> RankPushes:
        """Every other rank starts pushing its heads of (slot, generation)'s `blocks` into `targets`."""
        if self.leases is None:
            raise RuntimeError("the tensor-parallel decode's lease channel is not set up")
        lpc = max(1, self.settings.layers_per_chunk)
        order = PushOrder(slot, generation, tuple(blocks), num_tokens, tuple(targets), timeout_s, lpc)
        return RankPushes(self.leases, order)

    def write_leases(self, own: Any) -> RankLeases:
        """Every rank's write leases, granted and ended with rank 0's (`RankLeases`)."""
        self.leases = RankLeases(own, self.group)
        return self.leases

    def close(self) -> None:
        """Tell the others to stop (the generation loop has stopped: no collective is running)."""
        if self.leases is not None and (self.model is None or not self.model.broken):
            self.leases.close()
        if self.model is None or not self.model.broken:
            try:
                self.group.broadcast(STOP)
            except GroupError as exc:
                log.warning(kv(event="tp_stop_unsent", error=str(exc)[:200]))


class DecodeFollower:
    """Rank 1.. of a tensor-parallel decode: its heads' pool, and the steps rank 0 describes."""

    def __init__(
        self,
        settings: WorkerSettings,
        engine: Engine,
        backend: TransferBackend,
        group: TPGroup,
        pusher: Callable[..., KVPusher],
    ) -> None:
        # `pusher`: a handed-over request's push (decode/migration.MigrationPusher; passed in, as
        # this package sits below the roles)
        self.settings, self.backend, self.group = settings, backend, group
        self.engine = engine = group_engine(engine, TENSOR_PARALLEL)
        self.pusher = pusher
        leader = KVLayout.from_dict(group.broadcast())
        layout = replace(leader, first_head=first_head(engine))
        self.pool = KVPool(backend, layout, device=settings.device)
        self.cache = engine.bind_pool(layout, self.pool.tensor)  # (paged: rank 0's blocks)
        self._tables: dict[int, tuple[int, ...]] = {}  # each slot's blocks as last bound here
        group.gather({"engine_id": settings.engine_id, "base_addr": self.pool.base_addr, "layout": layout.to_dict()})
        # Writes into this rank's pool only where rank 0 granted them (its engine is leased).
        self.leases = BlockWriteLeases(backend, self.pool.base_addr, layout)
        self._leaser = threading.Thread(
            target=serve_leases, args=(group, self.leases, self.push), name="tp-leases", daemon=True
        )
        self._leaser.start()
        self._stop = threading.Event()
        self._drainer = threading.Thread(target=self._drain, name="tp-notify-drain", daemon=True)
        self._drainer.start()

    def serve(self) -> None:
        """Run rank 0's steps until it says STOP (a failed collective raises GroupError)."""
        steps = 0
        while True:
            step = self.group.broadcast()
            if step == STOP:
                log.info(kv(event="tp_rank_stopped", rank=self.group.rank, steps=steps))
                return
            if step == IDLE:
                continue
            self.run_step(step)
            steps += 1

    def run_step(self, step: DecodeStep) -> None:
        for slot, blocks in zip(step.slots, step.tables, strict=True):
            if self._tables.get(slot) != blocks:  # (None: a slot this rank has not decoded yet)
                self.engine.bind_blocks(self.cache, slot, blocks)
                self._tables[slot] = blocks
        with torch.inference_mode():
            self.engine.decode_step(self.cache, step.slots, step.positions, step.tokens)

    def push(self, order: PushOrder) -> int | str:
        """Push this rank's heads of a handed-over request into its new decode (no notify: rank 0
        sends it once every rank's puts landed); the bytes, or why it failed."""
        from pdserve_worker.transfer.push import PushError, PushSource, layer_chunks

        layout = self.pool.layout
        source = PushSource(self.pool.base_addr, layout, order.slot, heads=layout.head_range)
        try:
            pusher = self.pusher(
                self.backend, source, order.blocks, order.targets, order.num_tokens, timeout_s=order.timeout_s
            )
        except (PushError, ValueError) as exc:
            return str(exc)
        try:
            for chunk in layer_chunks(layout.layer_range, order.layers_per_chunk):
                pusher.push_chunk(chunk)
            return pusher.settle().bytes
        except (PushError, TransferError, ValueError, RuntimeError) as exc:
            pusher.abort()
            log.warning(kv(event="tp_push_failed", rank=self.group.rank, slot=order.slot, error=str(exc)[:300]))
            return str(exc)

    def _drain(self) -> None:
        """Rank 0 starts requests on its own notification; these are emptied unread."""
        transfer = self.backend.engine
        while not self._stop.wait(DRAIN_EVERY_S):
            transfer.get_notifies()

    def close(self) -> None:
        """Stop draining and deregister the pool (the engine is finalized next, then `free`)."""
        self._stop.set()
        self._drainer.join(timeout=1.0)
        self.pool.deregister()

    def free(self) -> None:
        self.pool.free()
