"""What a decode's group adds to a plain decode, as the decode worker sees it: `GroupHooks`,
given by a layer-sharded group's leader (decode/layer_shards.LayerShardGroup) or a
tensor-parallel decode's rank 0 (ranks/decode.TPDecodeGroup), and the other members' pushes of
a handed-over request (`MemberPushes`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from pdserve_common.kv_layout import KVLayout
from pdserve_worker.engines.base import Engine
from pdserve_worker.kv.cache import KVCache
from pdserve_worker.kv.slots import Grant
from pdserve_worker.model.engine import Generator


class MemberPushes(Protocol):
    """The other members' pushes of one handed-over request (`GroupHooks.push_members`)."""

    def wait(self) -> int:
        """Their bytes, once every push landed; raises MemberUnavailable naming one that failed."""
        ...

    def settle(self) -> None:
        """Until none of them is still running (whatever their outcome)."""
        ...


class GroupHooks(Protocol):
    """What a layer-sharded group's leader does beyond a plain decode (`decode.layer_shards.LayerShardGroup`):
    its pool holds member 0's layers, its decode step hops through the followers, its grants
    name every member, and its KV is ready once every member's notification arrived."""

    def pool_layout(self, full: KVLayout) -> KVLayout:
        """The leader's own pool, given the whole model's."""
        ...

    def generator(self, engine: Engine, cache: KVCache) -> Generator[Any]:
        """The group's generator over the leader's `cache` (on the engine's `GroupEngine` side)."""
        ...

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
