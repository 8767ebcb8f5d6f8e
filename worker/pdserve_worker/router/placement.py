"""Which decode and which prefill serve a request: pure ranking over the known membership.

Decode: the most free slots first. The broker's view of a decode's load is as old as its last
keepalive (a third of the lease TTL), so the router also counts the requests it has in flight
there itself and takes the larger of the two as the slots in use: a burst of requests spreads
over the decodes at once instead of piling onto the one that looked idle a second ago.

Prefill: the shortest queue (prefill computes one prompt at a time and queues the rest, so the
shortest queue gives the earliest first token): the larger of the queue the prefill last
reported and this router's own requests in flight there.

Only active members of the router's model revision are candidates: a draining member takes
no new requests, and KV from another model or dtype would be garbage.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from pdserve_common.membership import Member, Role
from pdserve_worker.router.prefix_routing import BalanceBound


def compatible(member: Member, role: Role, revision: str) -> bool:
    """An active member of `role` that serves the same model revision. (A layer-sharded decode
    group registers only its leader, as one plain decode: its followers are no members.)"""
    return member.role == role and not member.draining and member.info.revision == revision


def estimated_used(member: Member, inflight: int) -> int:
    """Slots in use at a decode: the larger of its last report and this router's own count."""
    return max(member.load.slots_used, inflight)


def rank_decodes(members: Iterable[Member], inflight: Mapping[str, int], revision: str) -> list[Member]:
    """Candidate decodes, best first: most free slots, then fewest of our requests, then by id."""
    candidates = [m for m in members if compatible(m, Role.DECODE, revision)]

    def key(m: Member) -> tuple[int, int, str]:
        mine = inflight.get(m.worker_id, 0)
        free = m.info.slots_total - estimated_used(m, mine)
        return (-free, mine, m.worker_id)

    return sorted(candidates, key=key)


def prefer_cached(
    ranked: list[Member], cached: Mapping[str, int], inflight: Mapping[str, int], bound: BalanceBound
) -> list[Member]:
    """`ranked` (rank_decodes' order) with the decode holding the longest cached prefix of the
    prompt first (`cached`: tokens, by its reports), if its slots in use are within `bound` of
    the least used: a conversation goes back to its KV, but never to a decode far busier."""
    if not ranked or not any(cached.values()):
        return ranked
    used = {m.worker_id: estimated_used(m, inflight.get(m.worker_id, 0)) for m in ranked}
    least = min(used.values())
    fits = [m for m in ranked if bound.allows(used[m.worker_id], least) and m.info.slots_total > used[m.worker_id]]
    best = max(fits, key=lambda m: cached.get(m.worker_id, 0), default=None)
    if best is None or not cached.get(best.worker_id, 0):
        return ranked
    return [best, *(m for m in ranked if m is not best)]


def estimated_queue(member: Member, inflight: int) -> int:
    """Requests queued at a prefill: the larger of its last report and this router's own count."""
    return max(member.load.active_requests, inflight)


def rank_prefills(members: Iterable[Member], inflight: Mapping[str, int], revision: str) -> list[Member]:
    """Candidate prefills, best first: shortest estimated queue, then fewest of ours, then by id."""
    candidates = [m for m in members if compatible(m, Role.PREFILL, revision)]

    def key(m: Member) -> tuple[int, int, str]:
        mine = inflight.get(m.worker_id, 0)
        return (estimated_queue(m, mine), mine, m.worker_id)

    return sorted(candidates, key=key)
