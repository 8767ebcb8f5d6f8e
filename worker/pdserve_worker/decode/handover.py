"""A draining decode's hand-over of its running requests (decode/migration.py): the requests
parked for a Migrate (`book`), the one thread that pushes them (`executor`), and the push of one
into the targets another decode reserved, with a group's other members pushing their shares.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from pdserve_worker.decode.group_hooks import GroupHooks
from pdserve_worker.decode.migration import Handoff, HandoffBook, MigrationResult, PushPace, push_handoff
from pdserve_worker.kv.blocks import BlockTable
from pdserve_worker.kv.reservations import reservation_nonce
from pdserve_worker.kv.slots import Grant, SlotTable
from pdserve_worker.serving.settings import WorkerSettings
from pdserve_worker.transfer.base import TransferBackend
from pdserve_worker.transfer.pool import KVPool
from pdserve_worker.transfer.push import PushSource


class Handover:
    """The decode's handed-over requests and their pushes; `close` releases what is left and
    waits for a push still reading the pool (before the pool is deregistered)."""

    def __init__(
        self,
        settings: WorkerSettings,
        backend: TransferBackend,
        pool: KVPool,
        slots: SlotTable | BlockTable,
        group: GroupHooks | None,
    ) -> None:
        self.settings, self.backend, self.pool, self.slots, self.group = settings, backend, pool, slots, group
        self.book = HandoffBook()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="decode-migrate")

    @property
    def supported(self) -> bool:
        """Whether this decode can hand its requests over when draining (every kind can now: a
        group's members and a tensor-parallel decode's ranks push their shares)."""
        return self.group is None or self.group.migrates

    def push(self, handoff: Handoff, targets: list[Grant]) -> MigrationResult:
        """Push a handed-over request's KV from this pool into `targets` (blocking). A layer-
        sharded group's followers push their layers meanwhile; the notify waits for them, and
        however this ends, no follower is still reading its pool when it returns."""
        # (a tensor-parallel rank 0 pushes only its heads; the other ranks push theirs)
        layout = self.pool.layout
        source = PushSource(self.pool.base_addr, layout, handoff.slot, heads=layout.head_range)
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
                PushPace(self.settings.layers_per_chunk, timeout_s),
                before_notify=None if members is None else members.wait,
            )
        finally:
            if members is not None:
                members.settle()

    def close(self) -> None:
        self.book.release_all()
        self.executor.shutdown(wait=True)  # a push reading the pool ends before it is deregistered
