"""Grants: decode slot reservations, and their return when a request will not finish with them.

`reserve_prompt` asks the ranked decodes for a slot in turn (worker.proto's Reserve), the one
whose prefix cache holds the prompt first, telling each the prompt and its cache scope; a later
copy of a prompt asks the decode holding the first copy's KV first (`sharing_first`);
`reserve_decode` reserves without a prompt (a migration's target). A Reserve in flight counts
at its decode, so a burst spreads.
`give_back` returns a grant a request leaves unfinished: free at once where no write into
the slot can still arrive, else quarantined by the decode, else reclaimed by its lease.
`Grants` is also the narrow `router/migration.DecodePort` a migration uses.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Mapping
from typing import Any

import grpc

from pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve_common.logs import kv
from pdserve_common.membership import Member, Role
from pdserve_worker.api import prompt_copies
from pdserve_worker.api.backend import BackendUnavailable, InvalidPrompt, NoCapacity, capacity_held
from pdserve_worker.router.members import Members
from pdserve_worker.rpc.trailers import never_sent, push_settled

log = logging.getLogger(__name__)

NO_CAPACITY_RETRY_S = 1.0


class Grants:
    """Reserve and give back decode slots through `members`' channels."""

    def __init__(self, members: Members) -> None:
        self.members = members
        self._t = members.config.timeouts

    def channel(self, member: Member) -> grpc.aio.Channel:
        return self.members.channel(member)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        self.members.spawn(coro)

    async def reserve_prompt(
        self, request_id: str, tokens: list[int], max_tokens: int, avoid: Mapping[str, int], cache_scope: str
    ) -> tuple[Member, worker_pb2.Grant, bool]:
        """A grant for `tokens` (the prompt and any streamed tokens) + `max_tokens` on the best
        decode that has room: the one whose prefix cache holds them, then the least used; and
        whether its shared blocks are another copy's (else its prefix cache's)."""
        ranked = self.members.ranked_decodes_for(avoid, tokens, cache_scope)
        request = worker_pb2.ReserveRequest(
            request_id=request_id,
            num_prompt_tokens=len(tokens),
            max_tokens=max_tokens,
            lease_ms=self._t.lease_ms,
            keep_for_copies=prompt_copies.later_copies(),
            prompt_token_ids=tokens,
            cache_scope=cache_scope,
        )
        return await self._reserve(ranked, request)

    async def reserve_decode(
        self, request_id: str, num_prompt_tokens: int, max_tokens: int, avoid: Mapping[str, int]
    ) -> tuple[Member, worker_pb2.Grant]:
        """A grant of that many tokens on the least used decode, without its prompt (a
        migration's: its KV comes from another decode, and its blocks are not kept after)."""
        request = worker_pb2.ReserveRequest(
            request_id=request_id,
            num_prompt_tokens=num_prompt_tokens,
            max_tokens=max_tokens,
            lease_ms=self._t.lease_ms,
            keep_for_copies=prompt_copies.later_copies(),
        )
        member, grant, _ = await self._reserve(self.members.ranked(Role.DECODE, avoid), request)
        return member, grant

    async def _reserve(
        self, ranked: list[Member], request: worker_pb2.ReserveRequest
    ) -> tuple[Member, worker_pb2.Grant, bool]:
        request_id = request.request_id
        ranked, sharing = sharing_first(ranked, request)
        full, failed = 0, []
        for member in ranked:
            stub = worker_pb2_grpc.DecodeStub(self.channel(member))
            asked = sharing if sharing is not None and member is ranked[0] else request
            reserve = asyncio.ensure_future(stub.Reserve(asked, timeout=self._t.rpc_s))
            # Counted in flight there while it reserves: a burst's other requests, ranking now,
            # see it (the attempt counts its own once granted, with no await in between).
            self.members.inflight_decode[member.worker_id] += 1
            try:
                # Shielded: cancelled while the Reserve is in flight (the client left), the call
                # goes on, and a grant that arrives anyway is given back instead of lost.
                grant = await asyncio.shield(reserve)
                capacity_held()  # the admission queue may let the next request try
                return member, grant, asked is sharing
            except asyncio.CancelledError:
                self.spawn(self._give_back_late(member, reserve, request_id))
                raise
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise InvalidPrompt(f"decode {member.worker_id}: {exc.details()}") from None
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    full += 1
                else:
                    failed.append(f"{member.worker_id}: {code.name} {exc.details()}")
                    log.warning(
                        kv(event="reserve_failed", decode=member.worker_id, code=code.name, detail=exc.details())
                    )
            finally:
                self.members.inflight_decode[member.worker_id] -= 1
        if full:
            raise NoCapacity(NO_CAPACITY_RETRY_S, f"no free KV slot on {full} decode worker(s)")
        raise BackendUnavailable(f"no decode worker could reserve a slot: {'; '.join(failed)}")

    async def _give_back_late(self, decode: Member, reserve: asyncio.Future[worker_pb2.Grant], request_id: str) -> None:
        """A Reserve whose request was cancelled while it was in flight: give back what it granted."""
        await asyncio.wait({reserve})  # (`wait`: the call's own failure or cancellation does not raise here)
        if reserve.cancelled() or reserve.exception() is not None:
            return  # nothing was granted
        await self.give_back(decode, reserve.result(), request_id, None, None)

    async def give_back(
        self,
        decode: Member,
        grant: worker_pb2.Grant,
        request_id: str,
        prefill: Member | None,
        prefill_call: asyncio.Future[worker_pb2.PrefillReply] | None,
    ) -> None:
        """Return a grant the request will not finish with, counted by how it went back.

        Free at once (`push_settled`) where no write into the slot can still arrive: no Prefill
        was sent, or the prefill answered that its push is over (after a Cancel, if it was still
        running). Otherwise the decode quarantines the slot; if even the Release fails, the
        decode's lease takes the slot back on its own.
        """
        settled = prefill_call is None or await self._settle_push(prefill, prefill_call, grant, request_id)
        released = await self.release_decode(decode, grant, settled)
        if released is None:
            outcome = "lease"
        elif not released:
            outcome = "stream"  # nothing left to give back: the decode's stream had the slot
        else:
            outcome = "released" if settled else "quarantined"
        log.debug(
            kv(
                event="grant_returned",
                request=request_id,
                decode=decode.worker_id,
                slot=grant.slot,
                generation=grant.generation,
                outcome=outcome,
            )
        )
        if self.members.metrics is not None:
            self.members.metrics.observe_grant_returned(outcome)

    async def _settle_push(
        self,
        prefill: Member | None,
        prefill_call: asyncio.Future[worker_pb2.PrefillReply],
        grant: worker_pb2.Grant,
        request_id: str,
    ) -> bool:
        """Whether the prefill's push into `grant` is over: asks a prefill still at work to stop
        and waits (at most `settle_s`) for its answer. False when that cannot be known."""
        if not prefill_call.done() and prefill is not None:
            try:
                await worker_pb2_grpc.PrefillStub(self.channel(prefill)).Cancel(
                    worker_pb2.CancelPrefillRequest(
                        request_id=request_id, slot=grant.slot, generation=grant.generation
                    ),
                    timeout=self._t.rpc_s,
                )
            except grpc.aio.AioRpcError as exc:
                log.warning(
                    kv(
                        event="prefill_cancel_failed",
                        prefill=prefill.worker_id,
                        request=request_id,
                        code=exc.code().name,
                    )
                )
            done, _ = await asyncio.wait({prefill_call}, timeout=self._t.settle_s)
            if not done:
                prefill_call.cancel()
                return False
        if prefill_call.cancelled():
            return False
        error = prefill_call.exception()
        return error is None or (isinstance(error, grpc.aio.AioRpcError) and (push_settled(error) or never_sent(error)))

    async def release_decode(self, decode: Member, grant: worker_pb2.Grant, push_settled: bool) -> bool | None:
        """worker.proto's Release; None when it could not be delivered (the lease then lapses)."""
        stub = worker_pb2_grpc.DecodeStub(self.channel(decode))
        try:
            reply = await stub.Release(
                worker_pb2.ReleaseRequest(
                    request_id=grant.request_id, slot=grant.slot, generation=grant.generation, push_settled=push_settled
                ),
                timeout=self._t.rpc_s,
            )
        except grpc.aio.AioRpcError as exc:  # the lease lapses on its own: logged, not fatal
            log.warning(kv(event="release_failed", decode=decode.worker_id, slot=grant.slot, code=exc.code().name))
            return None
        return bool(reply.released)


def sharing_first(
    ranked: list[Member], request: worker_pb2.ReserveRequest
) -> tuple[list[Member], worker_pb2.ReserveRequest | None]:
    """A later copy of a prompt (api/prompt_copies.py): the decode holding the first copy's KV
    first, asked to share its prompt blocks (push once); any other decode gets the plain
    request. Unchanged when there is no first copy to share with, or its decode is not a choice."""
    shared = prompt_copies.shared_decode()
    first = None if shared is None else next((m for m in ranked if m.worker_id == shared[0]), None)
    if shared is None or first is None:
        return ranked, None
    sharing = worker_pb2.ReserveRequest()
    sharing.CopyFrom(request)
    sharing.share_from.slot, sharing.share_from.generation = shared[1], shared[2]
    return [first, *(m for m in ranked if m is not first)], sharing
