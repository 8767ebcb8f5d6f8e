"""worker.proto's Decode service over a `DecodeWorker`, and the decode role that serves it.

Reserve grants a slot (or blocks) for a request; Generate streams its tokens once its KV is in
(decode/generate_call.py); Migrate pushes a parked request's KV to another decode; Release gives
back a grant nobody will use; Status reports the pool. Authentication ran before these methods.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc

from pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve_common import tracing
from pdserve_common.logs import kv
from pdserve_worker.api.cache_scope import MAX_CACHE_SCOPE_CHARS
from pdserve_worker.decode.generate_call import GenerateRoad
from pdserve_worker.decode.migration import HandoffUnavailable
from pdserve_worker.decode.worker import DecodeWorker
from pdserve_worker.kv.blocks import BlockTable
from pdserve_worker.kv.decode_prefix import CachedPrompt
from pdserve_worker.kv.slots import NoFreeSlot
from pdserve_worker.ranks.group import MemberUnavailable
from pdserve_worker.rpc.convert import block_events_to_proto, grant_to_proto, push_targets_from_proto
from pdserve_worker.rpc.trailers import settled_trailer
from pdserve_worker.transfer.base import TransferError
from pdserve_worker.transfer.push import PushError

log = logging.getLogger(__name__)


class DecodeServicer(worker_pb2_grpc.DecodeServicer):
    """worker.proto's Decode service over a `DecodeWorker` (auth ran before these methods)."""

    def __init__(self, worker: DecodeWorker) -> None:
        self.w = worker
        self.road = GenerateRoad(worker)

    async def Reserve(self, request: worker_pb2.ReserveRequest, context: grpc.aio.ServicerContext) -> worker_pb2.Grant:
        w = self.w
        if w.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"decode {w.settings.member_id} is draining")
        need = request.num_prompt_tokens + request.max_tokens
        if request.num_prompt_tokens == 0 or need > w.layout.max_len:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"num_prompt_tokens ({request.num_prompt_tokens}) + max_tokens ({request.max_tokens}) = {need} "
                f"must be in 1..{w.layout.max_len} (the slots' max_len)",
            )
        if len(request.cache_scope) > MAX_CACHE_SCOPE_CHARS:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"cache_scope of {len(request.cache_scope)} characters, at most {MAX_CACHE_SCOPE_CHARS}",
            )
        if request.prompt_token_ids and len(request.prompt_token_ids) != request.num_prompt_tokens:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"prompt_token_ids has {len(request.prompt_token_ids)} tokens, num_prompt_tokens says "
                f"{request.num_prompt_tokens}",
            )
        ttl_s = (request.lease_ms or w.settings.lease_ms) / 1000
        try:
            grant = w.reserve(
                request.request_id,
                ttl_s,
                request.num_prompt_tokens,
                request.max_tokens,
                share_of(request),
                request.keep_for_copies,
            )
        except NoFreeSlot as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        log.debug(
            kv(
                event="slot_granted",
                request=request.request_id,
                slot=grant.slot,
                generation=grant.generation,
                shared_blocks=grant.shared,
            )
        )
        if grant.shared:
            w.metrics.kv_shared_blocks.inc(grant.shared)
        deadline_ms = int((time.time() + ttl_s) * 1000)
        reply = grant_to_proto(grant, worker_id=w.settings.member_id, lease_deadline_unix_ms=deadline_ms)
        reply.group_grants.extend(
            grant_to_proto(g, worker_id=w.settings.member_id, lease_deadline_unix_ms=deadline_ms)
            for g in w.group_grants(grant)
        )
        return reply

    async def Generate(
        self, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.TokenEvent]:
        """Validate, wait for the KV, start the request in the batch, stream its tokens
        (decode/generate_call.py)."""
        async for event in self.road.run(request, context):
            yield event

    async def Migrate(
        self, request: worker_pb2.MigrateRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.MigrateReply:
        w = self.w
        where = f"slot {request.slot} generation {request.generation} (request {request.request_id})"
        try:
            handoff = w.handoffs.take(request.request_id, request.slot, request.generation)
        except HandoffUnavailable as exc:
            context.set_trailing_metadata(settled_trailer(True))
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        try:
            targets = push_targets_from_proto(request)
        except ValueError as exc:
            handoff.finish(migrated=False)
            w.metrics.observe_handoff(handoff.outcome or "released")
            context.set_trailing_metadata(settled_trailer(True))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{where}: {exc}")
        started, started_ns = time.monotonic(), tracing.now_ns()
        push = asyncio.get_running_loop().run_in_executor(w.handover.executor, w.handover.push, handoff, targets)
        # However this call ends (even cancelled), the KV is freed only once the push stopped reading it.
        push.add_done_callback(lambda f: handoff.finish(migrated=not f.cancelled() and f.exception() is None))
        try:
            result = await asyncio.shield(push)
        except (PushError, TransferError, ValueError, MemberUnavailable) as exc:
            w.metrics.observe_handoff(handoff.outcome or "released")
            log.warning(kv(event="migration_failed", request=request.request_id, slot=request.slot, error=str(exc)))
            # A push that failed was aborted: its puts reached a terminal state or were given up on.
            context.set_trailing_metadata(settled_trailer(isinstance(exc, ValueError)))
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{where}: migration failed: {exc}")
        seconds = time.monotonic() - started
        w.metrics.observe_handoff(handoff.outcome or "migrated", result.stats.bytes, seconds)
        tracing.record(
            "decode.migrate",
            started_ns,
            tracing.now_ns(),
            {
                "pdserve.request_id": request.request_id,
                "pdserve.decode.member": w.settings.member_id,
                "pdserve.kv_tokens": result.num_tokens,
                "pdserve.kv_bytes": result.stats.bytes,
            },
            parent=tracing.extract(context.invocation_metadata()),
        )
        log.info(
            kv(
                event="request_migrated",
                request=request.request_id,
                tokens=result.num_tokens,
                bytes=result.stats.bytes,
                seconds=f"{seconds:.4f}",
                targets=",".join(t.engine_id for t in targets),
            )
        )
        return worker_pb2.MigrateReply(
            num_tokens=result.num_tokens, kv_bytes=result.stats.bytes, push_seconds=result.stats.seconds
        )

    async def Release(
        self, request: worker_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ReleaseReply:
        # Only a grant still waiting for its Generate (or quarantined for it) is released here; a
        # committed slot is the generation loop's until its request leaves the batch.
        released = self.w.slots.release_grant(request.slot, request.generation, push_settled=request.push_settled)
        log.debug(
            kv(
                event="grant_released",
                request=request.request_id,
                slot=request.slot,
                generation=request.generation,
                push_settled=request.push_settled,
                released=released,
            )
        )
        return worker_pb2.ReleaseReply(released=released)

    async def BlockEvents(
        self, request: worker_pb2.BlockEventsRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.BlockEventsReply:
        """What this decode's prefix cache holds (kv/decode_prefix.py), as a prefill reports its own."""
        table = self.w.slots
        prefix = table.prefix if isinstance(table, BlockTable) else None
        if prefix is None or prefix.events is None:
            return worker_pb2.BlockEventsReply(enabled=False)
        # A snapshot reads every held hash: off the event loop.
        batch = await asyncio.to_thread(prefix.events.since, request.epoch, request.after_seq)
        return block_events_to_proto(batch, prefix.salt, prefix.block_tokens)

    async def Status(
        self, request: worker_pb2.StatusRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.DecodeStatus:
        return self.w.status()


def share_of(request: worker_pb2.ReserveRequest) -> tuple[int, int] | CachedPrompt | None:
    """What a Reserve may share: another copy's reservation, or what the prefix cache holds of its prompt."""
    if request.HasField("share_from"):
        return request.share_from.slot, request.share_from.generation
    return CachedPrompt(tuple(request.prompt_token_ids), request.cache_scope) if request.prompt_token_ids else None


class DecodeRole(DecodeWorker):
    """A decode worker with its gRPC service: the `ServingRole` process/roles.py makes."""

    def add_to(self, server: grpc.aio.Server) -> None:
        worker_pb2_grpc.add_DecodeServicer_to_server(DecodeServicer(self), server)
