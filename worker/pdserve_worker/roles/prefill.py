"""The prefill role: compute a prompt's KV chunk of layers by chunk, pushing each chunk as it is done.

`model.prefill(..., layers_per_chunk, on_chunk=pusher.push_chunk)` writes the KV of each layer
chunk into a local scratch pool that is registered with the transfer engine (the source
memory), and the pusher issues that chunk's puts at once, so the transfer of chunk k overlaps
the compute of chunk k+1. The first token is sampled here from the last position's logits,
and `finish()` sends it in the ready notification, after every put completed: a decode never
reads a partial push. Any failure aborts the push and sends no notification; the decode's
lease then lapses and quarantines the slot.

One model, one scratch slot: prefills run one after another on one compute thread (they are
compute bound, running two at once would only split the cores), while the gRPC event loop
stays free to accept and queue requests. Connections to decode engines are made by the
first push to each and then kept by the engine (a later connect answers ALREADY_CONNECTED);
a decode that leaves the membership is disconnected.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
from pydantic import ValidationError

from pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve_worker.kv.cache import KVCache
from pdserve_worker.kv.pool import KVPool
from pdserve_worker.kv.slots import NONCE_BYTES
from pdserve_worker.logs import kv
from pdserve_worker.model.loader import LoadedModel
from pdserve_worker.model.sampling import Sampler
from pdserve_worker.model.sampling_params import SamplingParams
from pdserve_worker.rpc.convert import layout_from_proto, sampling_from_proto
from pdserve_worker.rpc.membership import EventType, Load, MemberEvent, MemberInfo, Role
from pdserve_worker.settings import WorkerSettings
from pdserve_worker.transfer.engine import TransferBackend
from pdserve_worker.transfer.push import KVPusher, PushError, PushSource, PushTarget

log = logging.getLogger("pdserve.prefill")


@dataclass(frozen=True)
class PrefillResult:
    first_token: int
    num_tokens: int
    kv_bytes: int
    push_seconds: float
    prefill_seconds: float


class PrefillWorker:
    def __init__(self, settings: WorkerSettings, loaded: LoadedModel, backend: TransferBackend, revision: str) -> None:
        self.settings = settings
        self.loaded = loaded
        self.backend = backend
        self.revision = revision
        layout = loaded.config.kv_layout(1, settings.max_length, settings.model_dtype)
        self.pool = KVPool(backend, layout, device=settings.device)
        self.cache = KVCache(layout, self.pool.tensor)
        self.source = PushSource(self.pool.base_addr, layout, slot=0)
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefill-compute")
        self.queued = 0  # requests accepted and not yet answered
        self.served = 0

    def member_info(self) -> MemberInfo:
        return MemberInfo(
            worker_id=self.settings.member_id,
            role=Role.PREFILL,
            grpc_endpoint=self.settings.grpc_endpoint,
            revision=self.revision,
            labels={"model": self.loaded.name},
        )

    def load(self) -> Load:
        """Reported with each keepalive: requests queued or computing here (routers rank by it)."""
        return Load(active_requests=self.queued)

    def close(self) -> None:
        """Stop computing; `free` after the engine is finalized (no put of ours still reads)."""
        self._compute.shutdown(wait=True, cancel_futures=True)
        self.pool.deregister()

    def free(self) -> None:
        self.pool.free()

    def on_member(self, event: MemberEvent) -> None:
        """A decode that left will not be pushed to again: drop the link to its engine."""
        member = event.member
        if event.type is EventType.REMOVED and member is not None and member.info.engine_id:
            status = self.backend.engine.disconnect(member.info.engine_id, 1000)
            log.info(kv(event="decode_disconnected", decode=member.worker_id, engine=member.info.engine_id,
                        status=status))

    async def prefill(self, request_id: str, prompt: list[int], params: SamplingParams,
                      targets: list[PushTarget], num_generated: int) -> PrefillResult:
        """Queue one prefill on the compute thread and wait for it (the event loop stays free)."""
        self.queued += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._compute, self._run, request_id, prompt, params, targets, num_generated, time.perf_counter()
            )
        finally:
            self.queued -= 1

    def _run(self, request_id: str, prompt: list[int], params: SamplingParams, targets: list[PushTarget],
             num_generated: int, accepted: float) -> PrefillResult:
        s = self.settings
        started = time.perf_counter()
        pusher = KVPusher(
            self.backend, self.source, targets, len(prompt),
            queue_depth=s.queue_depth,
            timeout_s=s.transfer_timeout_ms / 1000,
            connect_timeout_ms=s.connect_timeout_ms,
        )
        try:
            logits = self.loaded.model.prefill(prompt, self.cache, 0, s.layers_per_chunk, on_chunk=pusher.push_chunk)
            first = Sampler(params).sample(logits, num_generated)
            stats = pusher.finish({"first_token": first})
        except BaseException:
            pusher.abort()
            raise
        done = time.perf_counter()
        self.served += 1
        log.info(kv(event="prefill_done", request=request_id, tokens=len(prompt), targets=len(targets),
                    kv_bytes=stats.bytes, queued_ms=round((started - accepted) * 1000, 1),
                    compute_ms=round((done - started) * 1000, 1), push_ms=round(stats.seconds * 1000, 1)))
        return PrefillResult(first, len(prompt), stats.bytes, stats.seconds, done - accepted)


def targets_from_proto(request: worker_pb2.PrefillRequest) -> list[PushTarget]:
    """The request's grants as push targets; ValueError names a grant that is not usable."""
    targets = []
    for i, grant in enumerate(request.targets):
        if not grant.engine_id or not grant.base_addr:
            raise ValueError(f"targets[{i}] lacks engine_id or base_addr: {grant.engine_id!r} {grant.base_addr:#x}")
        if len(grant.nonce) != NONCE_BYTES:
            raise ValueError(f"targets[{i}] lacks its reservation's nonce ({len(grant.nonce)} bytes, need "
                             f"{NONCE_BYTES}): pass the decode's Reserve answer unchanged")
        targets.append(PushTarget(
            engine_id=grant.engine_id,
            base_addr=grant.base_addr,
            layout=layout_from_proto(grant.kv_layout),
            slot=grant.slot,
            generation=grant.generation,
            request_id=grant.request_id or request.request_id,
            nonce=grant.nonce.hex(),
        ))
    if not targets:
        raise ValueError("targets is empty: a prefill needs at least one granted decode slot")
    return targets


class PrefillServicer(worker_pb2_grpc.PrefillServicer):
    def __init__(self, worker: PrefillWorker) -> None:
        self.w = worker

    async def Prefill(self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext) -> worker_pb2.PrefillReply:
        prompt = list(request.prompt_token_ids)
        vocab = self.w.loaded.config.vocab_size
        if not prompt:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids is empty")
        if min(prompt) < 0 or max(prompt) >= vocab:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"prompt_token_ids must be in 0..{vocab - 1}, got {min(prompt)}..{max(prompt)}")
        if len(prompt) > self.w.cache.layout.max_len:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"prompt of {len(prompt)} tokens exceeds this prefill's max_len {self.w.cache.layout.max_len}")
        try:
            params = sampling_from_proto(request.sampling)
            targets = targets_from_proto(request)
        except (ValueError, ValidationError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            result = await self.w.prefill(request.request_id, prompt, params, targets, request.num_generated)
        except PushError as exc:
            log.warning(kv(event="push_failed", request=request.request_id, error=str(exc)))
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV push failed: {exc}")
        except ValueError as exc:  # a target whose layout does not fit this model's KV
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return worker_pb2.PrefillReply(
            first_token=result.first_token,
            num_tokens=result.num_tokens,
            kv_bytes=result.kv_bytes,
            push_seconds=result.push_seconds,
            prefill_seconds=result.prefill_seconds,
        )
