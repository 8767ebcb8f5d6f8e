"""worker.proto's Prefill service over a `PrefillWorker`, and the prefill role that serves it.

Prefill checks a prompt and its push targets, runs it through the worker's batches and answers
with its first token once every put landed; each error becomes a status code and a trailer that
says whether any put can still land (rpc/trailers.py). Cancel stops a queued or running prompt;
BlockEvents serves the prefix cache's block events to routers. Authentication ran before these.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
from pydantic import ValidationError

from pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve_common import tracing
from pdserve_common.logs import kv
from pdserve_worker.api.cache_scope import MAX_CACHE_SCOPE_CHARS
from pdserve_worker.kv.slots import Grant
from pdserve_worker.model.sampling.grammar import GrammarError
from pdserve_worker.model.sampling.params import SamplingParams
from pdserve_worker.prefill.jobs import InstanceBroken, PrefillCancelled, PrefillResult, push_settled_of
from pdserve_worker.prefill.worker import PrefillWorker
from pdserve_worker.rpc.convert import (
    block_events_to_proto,
    logprobs_to_proto,
    push_targets_from_proto,
    sampling_from_proto,
)
from pdserve_worker.rpc.trailers import settled_trailer
from pdserve_worker.transfer.push import PushError

log = logging.getLogger(__name__)


class PrefillServicer(worker_pb2_grpc.PrefillServicer):
    """worker.proto's Prefill service over a `PrefillWorker` (auth ran before these methods)."""

    def __init__(self, worker: PrefillWorker) -> None:
        self.w = worker

    async def Prefill(
        self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PrefillReply:
        prompt = list(request.prompt_token_ids)
        settled = settled_trailer(True)  # nothing is put before the prefill runs
        if self.w.draining:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"prefill {self.w.settings.member_id} is draining", settled
            )
        refusal = self._refusal(request, prompt)
        if refusal is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refusal, settled)
        try:
            params = sampling_from_proto(request.sampling)
            targets = push_targets_from_proto(request)
        except (ValueError, ValidationError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc), settled)
        with tracing.span(
            "prefill",
            {
                "pdserve.request_id": request.request_id,
                "pdserve.prefill.member": self.w.settings.member_id,
                "gen_ai.usage.input_tokens": len(prompt),
                "pdserve.resumed_tokens": request.num_generated or None,
            },
            parent=tracing.extract(context.invocation_metadata()),
        ) as trace:
            result = await self._prefill(request, prompt, params, targets, context, trace)
            trace.set_attributes(
                {
                    "pdserve.kv.bytes": result.kv_bytes,
                    "pdserve.push.seconds": result.push_seconds,
                    "pdserve.prefix.cached_tokens": result.cached_tokens,
                }
            )
        return worker_pb2.PrefillReply(
            first_token=result.first_token,
            num_tokens=result.num_tokens,
            kv_bytes=result.kv_bytes,
            push_seconds=result.push_seconds,
            prefill_seconds=result.prefill_seconds,
            cached_tokens=result.cached_tokens,
            prompt_logprobs=[logprobs_to_proto(entry) for entry in result.prompt_logprobs],
        )

    def _refusal(self, request: worker_pb2.PrefillRequest, prompt: list[int]) -> str | None:
        """Why the request is invalid (None: it is not)."""
        vocab, max_len = self.w.engine.config.vocab_size, self.w.cache.layout.max_len
        if not prompt:
            return "prompt_token_ids is empty"
        if min(prompt) < 0 or max(prompt) >= vocab:
            return f"prompt_token_ids must be in 0..{vocab - 1}, got {min(prompt)}..{max(prompt)}"
        if len(prompt) > max_len:
            return f"prompt of {len(prompt)} tokens exceeds this prefill's max_len {max_len}"
        if len(request.cache_scope) > MAX_CACHE_SCOPE_CHARS:
            return f"cache_scope has {len(request.cache_scope)} characters, at most {MAX_CACHE_SCOPE_CHARS}"
        return None

    async def _prefill(
        self,
        request: worker_pb2.PrefillRequest,
        prompt: list[int],
        params: SamplingParams,
        targets: list[Grant],
        context: grpc.aio.ServicerContext,
        trace: Any,
    ) -> PrefillResult:
        try:
            return await self.w.prefill(
                request.request_id,
                prompt,
                params,
                targets,
                request.num_generated,
                trace=trace,
                cache_scope=request.cache_scope,
            )
        except PrefillCancelled as exc:
            await context.abort(grpc.StatusCode.ABORTED, str(exc), settled_trailer(push_settled_of(exc)))
        except PushError as exc:
            log.warning(kv(event="push_failed", request=request.request_id, error=str(exc)))
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV push failed: {exc}", settled_trailer(False))
        except InstanceBroken as exc:  # another prefill can serve it
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc), settled_trailer(push_settled_of(exc)))
        except GrammarError as exc:  # the client's grammar, refused by the matcher: its fault, not the service's
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc), settled_trailer(push_settled_of(exc)))
        except ValueError as exc:  # a target whose layout does not fit this model's KV
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc), settled_trailer(push_settled_of(exc)))
        except Exception as exc:  # noqa: BLE001 - a bug: logged in full, answered without internals
            log.error(kv(event="prefill_failed", request=request.request_id, error=repr(exc)), exc_info=exc)
            await context.abort(
                grpc.StatusCode.INTERNAL,
                f"prefill of request {request.request_id} failed",
                settled_trailer(push_settled_of(exc)),
            )
        raise AssertionError("context.abort returned")  # it always raises

    async def Cancel(
        self, request: worker_pb2.CancelPrefillRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.CancelPrefillReply:
        found = self.w.cancel((request.request_id, request.slot, request.generation))
        log.debug(
            kv(
                event="prefill_cancel",
                request=request.request_id,
                slot=request.slot,
                generation=request.generation,
                found=found,
            )
        )
        return worker_pb2.CancelPrefillReply(found=found)

    async def BlockEvents(
        self, request: worker_pb2.BlockEventsRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.BlockEventsReply:
        store = self.w.prefix
        if store is None:
            return worker_pb2.BlockEventsReply(enabled=False)
        # A snapshot reads every held hash: off the event loop.
        batch = await asyncio.to_thread(store.events.since, request.epoch, request.after_seq)
        return block_events_to_proto(batch, store.salt, store.block_tokens)


class PrefillRole(PrefillWorker):
    """A prefill worker with its gRPC service: the `ServingRole` process/roles.py makes."""

    def add_to(self, server: grpc.aio.Server) -> None:
        worker_pb2_grpc.add_PrefillServicer_to_server(PrefillServicer(self), server)
