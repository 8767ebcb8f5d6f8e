"""One Generate call on a decode, start to end: its checks, the wait for its KV, its place in
the batch, its token events, and the one way out (`end`) that every path takes.

`GenerateCall` is the call's state in one object; `GenerateRoad` walks it over a `DecodeWorker`
(decode/service.py's Generate streams what `run` yields). The slot is released if the call never
committed it, else cancelled in the generation loop, which frees it when the request leaves the
batch. A call parked by a drain is handed over (`handover_event`) and waits for the router's
Migrate (`await_migrate`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from pydantic import ValidationError

from pdserve.v1 import worker_pb2
from pdserve_common import tracing
from pdserve_worker.decode.generation_loop import InstanceEnding, Parked, Prefilled, RequestFailed, RequestStream
from pdserve_worker.decode.migration import MIGRATED, Handoff
from pdserve_worker.decode.worker import DecodeWorker, KVDamaged, Ready, ReadyUnusable
from pdserve_worker.kv.blocks import BlockTable
from pdserve_worker.model.sampling.params import FinishReason, SamplingParams
from pdserve_worker.model.sampling.sampler import stop_token_ids
from pdserve_worker.ranks.group import MemberUnavailable
from pdserve_worker.rpc.convert import finish_reason_to_proto, logprobs_to_proto, sampling_from_proto
from pdserve_worker.transfer.readiness import ReadinessTimeout, SlotNotReserved


def migration_mismatch(ready: Ready, prompt: list[int], num_generated: int, seed: int | None) -> str | None:
    """Why a migration's ready notify does not fit the request the router described (None: it
    fits): the source's state must be exactly the stream the router spliced, or the text would
    fork."""
    m = ready.message
    if not m.get(MIGRATED):
        return "a prefill's KV came for a migrated request"
    if ready.num_tokens != len(prompt) - 1 or ready.first_token != prompt[-1]:
        return (
            f"the source pushed {ready.num_tokens} tokens of KV ending before token {ready.first_token}, "
            f"the request has {len(prompt)} tokens ending with {prompt[-1]}"
        )
    if m.get("num_generated") != num_generated or m.get("seed") != seed:
        return "the source's generation state (tokens generated, seed) differs from the request's"
    return None


@dataclass
class GenerateCall:
    """One Generate call's state on the decode: what was asked, the span, and how far it got."""

    request: worker_pb2.GenerateRequest
    where: str
    prompt: list[int]
    resumed: int  # tokens the client already has (a resume or a migration)
    params: SamplingParams
    stop_ids: frozenset[int]
    timeout_s: float
    trace: Any
    index: int = 0  # the next event's index
    first: int | None = None  # the token the batch starts from
    stream: RequestStream | None = None
    finished: bool = False
    steps: int = 0
    first_step_ns: int = 0
    last_step_ns: int = 0

    @property
    def slot(self) -> int:
        return self.request.slot

    @property
    def generation(self) -> int:
        return self.request.generation


def kv_problem(g: GenerateCall, ready: Ready) -> str | None:
    """Why the KV that arrived is not this request's (None: it is)."""
    if g.request.migrated:
        return migration_mismatch(ready, g.prompt, g.resumed, g.params.seed)
    if ready.message.get(MIGRATED):
        return "a migration's KV came for a prefilled request"
    if ready.num_tokens != len(g.prompt):
        return f"prefill pushed {ready.num_tokens} tokens of KV, the prompt has {len(g.prompt)}"
    if g.params.logprobs is not None and ready.first_logprobs is None:
        return "the request asks for logprobs; the prefill's ready message has none for the first token"
    return None


class GenerateRoad:
    """The steps of a Generate call over one decode worker (module doc)."""

    def __init__(self, worker: DecodeWorker) -> None:
        self.w = worker

    async def run(
        self, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.TokenEvent]:
        """Validate, wait for the KV, start the request in the batch, stream its tokens. Every way
        out passes `_end`, which frees the slot unless the loop already owns it."""
        g = await self.validated(request, context)
        try:
            if request.local_prefill:
                ready = await self.commit_local(g, context)
                g.stream = self.start_local(g)
            else:
                ready = await self.await_kv(g, context)
                g.stream = self.start_stream(g, ready)
            async for out in g.stream:
                if isinstance(out, Parked):  # this decode is draining: hand the request over
                    g.trace.set_attribute("pdserve.handed_over", True)
                    yield await self.handover_event(out.handoff, g.generation, g.index, context, g.where)
                    await self.await_migrate(out.handoff, context, g.where)
                    return
                event = await self.token_event(g, out, ready, context)
                if event is None:
                    continue
                yield event
                if g.finished:
                    return
        except InstanceEnding as exc:  # (the router resumes the request, here once restarted)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{g.where}: {exc}")
        except RequestFailed as exc:
            await context.abort(grpc.StatusCode.INTERNAL, f"{g.where}: {exc}")
        except BaseException as exc:
            g.trace.record_exception(exc)
            raise
        finally:
            self.end(g)

    async def validated(self, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> GenerateCall:
        """The request's checks (INVALID_ARGUMENT), and the claim on its grant: from here its
        lease lasts as long as we are willing to wait for the KV."""
        w = self.w
        slot, generation, prompt = request.slot, request.generation, list(request.prompt_token_ids)
        where = f"slot {slot} generation {generation} (request {request.request_id})"
        resumed = request.num_generated
        if resumed >= len(prompt):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{where}: num_generated ({resumed}) must be below the {len(prompt)} tokens of "
                "prompt_token_ids (the prompt, then the tokens already streamed)",
            )
        if request.migrated and resumed < 1:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{where}: a migrated request has streamed tokens (num_generated >= 1), got 0",
            )
        try:
            params = sampling_from_proto(request.sampling)
        except ValidationError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{where}: sampling: {exc}")
        timeout_s = (request.readiness_timeout_ms or w.settings.readiness_timeout_ms) / 1000
        problem = w.note_prompt(slot, generation, prompt)
        if problem is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{where}: {problem}")
        if not w.slots.renew(slot, generation, timeout_s + 5.0):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{where} is not a live grant")
        # A streaming handler: its span is ended by hand (tracing.py on spans across yields).
        trace = tracing.start_span(
            "decode.generate",
            {
                "pdserve.request_id": request.request_id,
                "pdserve.decode.member": w.settings.member_id,
                "pdserve.slot": slot,
                "pdserve.slot.generation": generation,
                "gen_ai.usage.input_tokens": len(prompt),
                "pdserve.resumed_tokens": resumed or None,
            },
            parent=tracing.extract(context.invocation_metadata()),
        )
        stop_ids = stop_token_ids(params, w.engine.tokenizer.eos_token_ids)
        return GenerateCall(request, where, prompt, resumed, params, stop_ids, timeout_s, trace, index=resumed)

    async def await_kv(self, g: GenerateCall, context: grpc.aio.ServicerContext) -> Ready:
        """Wait for the prefill's (or a migration's) ready notice, check that its KV is this
        request's, and commit the slot."""
        w, slot, generation, where = self.w, g.slot, g.generation, g.where
        try:
            wait_ns = tracing.now_ns()
            ready = await w.wait_ready(slot, generation, g.timeout_s)
            tracing.record(
                "decode.notify_wait",
                wait_ns,
                tracing.now_ns(),
                {"pdserve.readiness": w.settings.readiness_mode, "pdserve.ready_wait_s": ready.wait_s},
                parent=g.trace,
            )
        except ReadinessTimeout as exc:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"{where}: {exc}")
        except SlotNotReserved as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{where}: {exc}")
        except KVDamaged as exc:
            await context.abort(grpc.StatusCode.DATA_LOSS, f"{where}: {exc}")
        except ReadyUnusable as exc:
            await context.abort(grpc.StatusCode.ABORTED, f"{where}: {exc}")
        except MemberUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{where}: {exc}")
        problem = kv_problem(g, ready)
        if problem is not None:
            await context.abort(grpc.StatusCode.ABORTED, f"{where}: {problem}")
        if not w.slots.commit(slot, generation):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{where}: the lease ended before the KV arrived")
        return ready

    async def commit_local(self, g: GenerateCall, context: grpc.aio.ServicerContext) -> Ready:
        """A request this decode prefills itself (decode/local_prefill.py): no KV is awaited; the
        slot is committed at once, as no peer writes it."""
        w, request, where = self.w, g.request, g.where
        if w.local_prefill is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"{where}: decode {w.settings.member_id} does not prefill locally"
            )
        if w.draining:  # (the router tries another decode: this one would compute it only to hand it over)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{where}: decode {w.settings.member_id} is draining")
        if request.migrated or g.resumed or g.params.prompt_logprobs is not None:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{where}: a local prefill starts from token 0 (not migrated, num_generated 0) without prompt logprobs",
            )
        if w.shared_tokens(g.slot, g.generation) >= len(g.prompt):  # (no position left to draw from)
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"{where}: a local prefill's grant shares every prompt position"
            )
        if not w.slots.commit(g.slot, g.generation):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{where}: the lease ended before Generate came")
        return Ready(num_tokens=len(g.prompt), first_token=-1, wait_s=0.0, kv_pushed=False)

    def start_local(self, g: GenerateCall) -> RequestStream:
        """Bind the request's blocks and hand it to the loop, which computes its prompt a chunk
        per turn and then decodes it; from here the loop owns the slot."""
        w, slot, generation = self.w, g.slot, g.generation
        w.adopt(slot, generation)
        w.metrics.local_prefills.inc()
        assert w.local_prefill is not None  # (commit_local refused the request otherwise)
        w.local_prefill.begin(slot, w.shared_tokens(slot, generation))  # blocks it shares hold their KV
        return w.loop.submit(
            g.request.request_id,
            g.prompt,
            slot,
            g.params,
            lambda: w.finished(slot, generation),
            keep_kv=keep_kv(w, slot, generation, len(g.prompt)),
        )

    def start_stream(self, g: GenerateCall, ready: Ready) -> RequestStream:
        """Hand the slot to the generation loop: from here the loop owns it and frees it when the
        request leaves the batch."""
        w, slot, generation, prompt = self.w, g.slot, g.generation, g.prompt
        w.adopt(slot, generation)
        # A migrated request: its KV lacks the last streamed token, which joins the batch as
        # the "first" token (its output, already streamed by the source, is not sent again).
        migrated = g.request.migrated
        kv_ids, g.first, replayed = (
            (prompt[:-1], prompt[-1], g.resumed - 1) if migrated else (prompt, ready.first_token, g.resumed)
        )
        if migrated:
            w.metrics.migrations_received.inc()
        g.index = replayed  # a resumed stream goes on at the index where the broken one stopped
        return w.loop.submit(
            g.request.request_id,
            kv_ids,
            slot,
            g.params,
            lambda: w.finished(slot, generation),
            Prefilled(g.first, replayed, None if migrated else ready.first_logprobs),
            keep_kv=keep_kv(w, slot, generation, len(g.prompt)),
        )

    async def token_event(
        self, g: GenerateCall, out: Any, ready: Ready, context: grpc.aio.ServicerContext
    ) -> worker_pb2.TokenEvent | None:
        """The stream's event for one generated token (None: a replayed token, not sent again)."""
        g.last_step_ns = tracing.now_ns()
        g.first_step_ns = g.first_step_ns or g.last_step_ns
        g.steps += 1
        if g.index < g.resumed:  # (a migrated request's last streamed token, replayed)
            if out.finished or out.token_id != g.first:
                await context.abort(
                    grpc.StatusCode.ABORTED, f"{g.where}: the migrated state does not replay to its last token"
                )
            g.index += 1
            return None
        event = worker_pb2.TokenEvent(index=g.index, text=out.text)
        if out.token_id is not None:
            event.token_id = out.token_id
        if out.logprobs is not None:
            event.logprobs.CopyFrom(logprobs_to_proto(out.logprobs))
        if g.index == g.resumed:
            event.kv_bytes_received = ready.kv_bytes
            event.kv_pushed = ready.kv_pushed
            event.ready_wait_s = ready.wait_s
            event.num_prompt_tokens = ready.num_tokens
        if out.finished:
            g.finished = True
            event.finish_reason = finish_reason_to_proto(out.finish_reason or FinishReason.STOP)
            if out.finish_reason is FinishReason.STOP and out.token_id in g.stop_ids:
                event.stop = str(out.token_id)  # a stop token; a stop string is not reported back
        g.index += 1
        return event

    def end(self, g: GenerateCall) -> None:
        """Every way out of Generate: the steps' span, then the slot — released if never
        committed (quarantined: a push may be in flight), else cancelled in the loop, which frees
        it once the request is out of the batch."""
        if g.steps:
            # One span for all the steps, not one per token: the first token came with the KV
            # (sampled by the prefill), every later one is a decode step in the batch.
            steps, first, last = g.steps, g.first_step_ns, g.last_step_ns
            tracing.record(
                "decode.steps",
                first,
                last,
                {
                    "pdserve.decode.steps": steps - 1,
                    "gen_ai.usage.output_tokens": steps,
                    "pdserve.decode.mean_step_ms": round((last - first) / 1e6 / (steps - 1), 3) if steps > 1 else None,
                    "pdserve.finished": g.finished,
                },
                parent=g.trace,
            )
        g.trace.set_attribute("pdserve.finished", g.finished)
        g.trace.end()
        if g.stream is None:
            self.w.slots.release(g.slot, g.generation)
        elif not g.finished:
            self.w.loop.cancel(g.stream)

    async def handover_event(
        self, handoff: Handoff, generation: int, index: int, context: grpc.aio.ServicerContext, where: str
    ) -> worker_pb2.TokenEvent:
        """The request was parked for a migration: the event that tells the router (`handover`),
        after the handoff is filed for the router's Migrate (drain mode resume: an error instead)."""
        w = self.w
        d = handoff.detached
        if index != len(d.output_ids):  # the stream and the generator disagree: never splice on that
            handoff.release()
            await context.abort(
                grpc.StatusCode.INTERNAL, f"{where}: parked after {len(d.output_ids)} tokens, streamed {index}"
            )
        if w.settings.drain_mode == "resume":
            handoff.release()
            w.metrics.observe_handoff(handoff.outcome or "released")
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"{where}: decode {w.settings.member_id} is draining: resume the request elsewhere",
            )
        w.handoffs.add(handoff, generation)
        return worker_pb2.TokenEvent(
            index=index,
            handover=worker_pb2.Handover(num_generated=len(d.output_ids), seed=d.seed, kv_tokens=d.kv_tokens),
        )

    async def await_migrate(self, handoff: Handoff, context: grpc.aio.ServicerContext, where: str) -> None:
        """Keep the KV until the router's Migrate pushed it or `migrate_wait_seconds` passed; then
        the handoff is released (a no-op after a Migrate) and the stream ends."""
        w = self.w
        deadline = time.monotonic() + w.settings.migrate_wait_seconds
        while not handoff.settled and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if handoff.state == Handoff.PARKED:
            handoff.release()
            w.metrics.observe_handoff(handoff.outcome or "released")
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"{where}: handed over, but no Migrate came within {w.settings.migrate_wait_seconds:g}s",
            )


def keep_kv(w: DecodeWorker, slot: int, generation: int, prompt: int) -> Callable[[list[int]], None] | None:
    """The generation loop's `keep_kv` for (slot, generation): what its blocks hold goes to the
    decode's prefix cache when it ends (kv/decode_prefix.py; None without one): the KV of its
    `prompt` tokens, which a prompt pass computed, and with `decode_prefix_answers` its answer's."""
    table = w.slots
    if not isinstance(table, BlockTable) or table.prefix is None:
        return None
    limit = None if w.settings.decode_prefix_answers else prompt
    return lambda token_ids: table.note_kv(slot, generation, token_ids[:limit])
