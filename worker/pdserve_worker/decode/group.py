"""A layer-sharded decode group as one decode instance: one slot table, N pools, N ready notifications.

The group is what a router sees as one decode: a request gets one slot index, granted on
every member (the same index and generation everywhere, so one decode step addresses the
same slot in each member's pool). A grant per member tells the prefill where that member's
pool is and which layers it holds; the prefill's `KVPusher` sends each member only its layers
and one `kv_ready` notification per member. The group starts decoding a request only once
every member's notification arrived and all of them agree on the prompt length and first
token: a member whose KV is missing would otherwise attend over garbage.

The slot table is the group leader's (member 0): leases, commit and release happen once for
the group, never per member, so members cannot disagree about who owns a slot. Each member's
`Readiness` only files notifications; it accepts one while the group's lease is live.

Here every member lives in this process (`DecodeGroup.local`): the engine-level form the
tests and benchmarks drive. Members in separate processes replace `local_hop` with an RPC
hop and keep the rest of this module.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from pdserve_worker.kv.cache import KVCache
from pdserve_worker.kv.pool import KVPool
from pdserve_worker.kv.slots import Grant, SlotTable
from pdserve_common.logs import kv
from pdserve_worker.model.generate import Generator
from pdserve_worker.model.llama import LlamaModel
from pdserve_worker.model.sharded import GroupKV, ShardedDecoder, ShardMember
from pdserve_worker.model.tokenizer import Tokenizer
from pdserve_worker.transfer.engine import TransferBackend
from pdserve_worker.transfer.readiness import Readiness, ReadinessTimeout

log = logging.getLogger("pdserve.decode_group")


class GroupNotReady(RuntimeError):
    """The members' ready notifications disagree (a push for another prompt, or a bug)."""


@dataclass(frozen=True)
class MemberEndpoint:
    """One member's transfer side: the engine that listens as `engine_id`, and its registered pool."""

    engine_id: str
    backend: TransferBackend
    pool: KVPool


@dataclass(frozen=True)
class GroupReady:
    num_tokens: int
    first_token: int
    wait_s: float


class DecodeGroup:
    """N members' pools and readiness behind one slot table; `generator` decodes across them."""

    def __init__(
        self,
        members: Sequence[MemberEndpoint],
        models: Sequence[LlamaModel],
        tokenizer: Tokenizer,
        *,
        quarantine_s: float = 15.0,
        readiness_mode: str = "interrupt",
    ) -> None:
        if len(members) != len(models) or not members:
            raise ValueError(f"a decode group needs one model per member, got {len(models)} for {len(members)}")
        self.members = tuple(members)
        self.kv = GroupKV([m.pool.layout for m in members], models[0].config.num_layers)  # checks the ranges tile the model
        self.slots = SlotTable(self.kv.layout, engine_id=members[0].engine_id, base_addr=members[0].pool.base_addr,
                               quarantine_s=quarantine_s)
        self.readiness = [
            Readiness(m.backend, readiness_mode, accepts=self.slots.is_reserved, authorize=self.slots.verify,
                      warmup=m.pool.warm) for m in members
        ]
        self.shards = [ShardMember(model, KVCache(m.pool.layout, m.pool.tensor)) for m, model in zip(members, models)]
        self.decoder = ShardedDecoder.local(self.shards)
        self.generator = Generator(self.decoder, tokenizer, self.kv)

    @property
    def size(self) -> int:
        return len(self.members)

    def reserve(self, request_id: str, ttl_s: float) -> list[Grant]:
        """One slot of the group: a grant per member, all with the same slot and generation.
        Raises NoFreeSlot like `SlotTable.reserve`."""
        grant = self.slots.reserve(request_id, ttl_s)
        return self.member_grants(grant)

    def member_grants(self, grant: Grant) -> list[Grant]:
        """The group's grant as each member's: that member's engine, pool base and layer range."""
        return [replace(grant, engine_id=m.engine_id, base_addr=m.pool.base_addr, layout=m.pool.layout)
                for m in self.members]

    def wait_ready(self, slot: int, generation: int, timeout_s: float) -> GroupReady:
        """Block until every member's ready notification for (slot, generation) arrived.

        The deadline is shared: a member that never gets its KV fails the whole request
        (ReadinessTimeout names it). Raises GroupNotReady when the members disagree."""
        started = time.monotonic()
        deadline = started + timeout_s
        messages = []
        for index, readiness in enumerate(self.readiness):
            left = max(deadline - time.monotonic(), 0.001)
            try:
                messages.append(readiness.wait(slot, generation, left))
            except ReadinessTimeout as exc:
                raise ReadinessTimeout(f"group member {index} ({self.members[index].engine_id}): {exc}") from None
        seen = {(int(m["num_tokens"]), int(m["first_token"])) for m in messages}
        if len(seen) != 1:
            raise GroupNotReady(f"slot {slot} generation {generation}: members report (num_tokens, first_token) {seen}")
        num_tokens, first_token = seen.pop()
        wait_s = time.monotonic() - started
        log.debug(kv(event="group_ready", slot=slot, generation=generation, members=self.size,
                     tokens=num_tokens, wait_ms=round(wait_s * 1000, 2)))
        return GroupReady(num_tokens, first_token, wait_s)

    def release(self, slot: int, generation: int) -> bool:
        for readiness in self.readiness:
            readiness.forget(slot)
        return self.slots.release(slot, generation)
