"""One request's run through the backend: token events in, text deltas out.

This is where the router's per-request rules live, independent of HTTP: `max_tokens` is
enforced even if a backend overruns it, the backend's generator is closed as soon as the
answer is complete (so its decode slot is freed at once), and the timestamps the metrics need
are taken. Stop strings are not cut here: the engine that generates the tokens decides when a
request is finished (`model.sampling.sampler.StopStringMatcher`, on the decode or the colocated
worker), ends it there and frees its slot; its text never holds a stop string.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import AbstractAsyncContextManager, aclosing, nullcontext
from dataclasses import dataclass
from typing import Any

from pdserve_common import tracing
from pdserve_common.logs import kv
from pdserve_worker.api.backend import Backend, RequestInfo, TokenEvent
from pdserve_worker.api.logprobs import Scored, prompt_scored
from pdserve_worker.api.metrics import RequestTiming
from pdserve_worker.model.sampling.params import FinishReason, SamplingParams, TokenLogprobs

log = logging.getLogger(__name__)


def _closing(events: AsyncIterator[TokenEvent]) -> AbstractAsyncContextManager[AsyncIterator[TokenEvent]]:
    """Close the backend's stream on exit: an async generator has `aclose` (the usual case)."""
    if isinstance(events, AsyncGenerator):
        return aclosing(events)
    return nullcontext(events)


@dataclass(frozen=True)
class Delta:
    """Text that may be shown now; `finish_reason` is set on the last delta only; `scored` is
    the token with its logprobs when the request asked for them."""

    text: str
    finish_reason: FinishReason | None = None
    scored: Scored | None = None


class Generation:
    """Drives `backend.generate` for one request and records what the metrics need.

    Exactly one consumer iterates `deltas()` once. It yields one delta per token event (the
    text may be empty, e.g. while the engine holds back a possible stop-string prefix), so a
    consumer that waits for the first delta waits for the first token, not for visible text.
    """

    def __init__(
        self,
        backend: Backend,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        arrived: float,
        trace: Any = tracing.NOOP,
        *,
        cache_scope: str,
    ) -> None:
        self._backend = backend
        self.trace = trace  # the request's span (tracing.py): current around every step of the backend
        self._prompt_ids = prompt_ids
        self._params = params
        self.request_id = request_id
        self.arrived = arrived
        self.completion_tokens = 0
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.finish_reason: FinishReason | None = None
        self.info: RequestInfo | None = None
        self.cache_scope = cache_scope  # which cached prefixes it may reuse (api/cache_scope.py)
        self.show_workers = False  # name the prefill and decode in the response (a debug header the key allows)
        self.prompt_logprobs: tuple[TokenLogprobs, ...] = ()  # the prompt's, when asked for (first event)

    @property
    def prompt_tokens(self) -> int:
        return len(self._prompt_ids)

    def echoed(self) -> list[Scored]:
        """The prompt's tokens with their logprobs (an echo), once the first event brought them."""
        return prompt_scored(self._prompt_ids, self.prompt_logprobs) if self.prompt_logprobs else []

    def timing(self, finished: float | None = None) -> RequestTiming:
        return RequestTiming(
            arrived=self.arrived,
            first_token=self.first_token,
            last_token=self.last_token,
            finished=time.monotonic() if finished is None else finished,
            completion_tokens=self.completion_tokens,
        )

    async def deltas(self) -> AsyncGenerator[Delta, None]:
        final: Delta | None = None
        # aclosing: leaving this block early (finish, cancellation) closes the backend's
        # generator, which is how the backend learns to release the request's slot.
        async with _closing(
            self._backend.generate(self._prompt_ids, self._params, self.request_id, cache_scope=self.cache_scope)
        ) as events:
            while True:
                with tracing.use(self.trace):  # the backend's spans and gRPC calls join the request's trace
                    try:
                        event = await events.__anext__()
                    except StopAsyncIteration:
                        break
                self._on_token(event.info)
                if event.prompt_logprobs is not None:
                    self.prompt_logprobs = event.prompt_logprobs
                scored = None if event.logprobs is None else Scored(event.token_id, event.logprobs)
                if event.finish_reason is not None:
                    final = Delta(event.text, FinishReason(event.finish_reason), scored)
                elif self.completion_tokens >= self._params.max_tokens:
                    final = Delta(event.text, FinishReason.LENGTH, scored)
                if final is not None:
                    break
                yield Delta(event.text, scored=scored)
        if final is None:
            log.warning(
                kv(
                    event="backend_ended_without_finish_reason",
                    request_id=self.request_id,
                    tokens=self.completion_tokens,
                )
            )
            final = Delta("", FinishReason.STOP)
        self.finish_reason = final.finish_reason
        yield final

    def end_trace(self, outcome: str) -> None:
        """End the request's span with what it came to (the ledger calls it once)."""
        info = self.info
        self.trace.set_attributes(
            {
                "pdserve.outcome": outcome,
                "gen_ai.usage.output_tokens": self.completion_tokens,
                "gen_ai.response.finish_reasons": self.finish_reason,
                "pdserve.ttft_s": None if self.first_token is None else round(self.first_token - self.arrived, 6),
                "pdserve.kv.bytes": info.kv_bytes if info is not None else None,
                "pdserve.prefill.member": getattr(info, "prefill", None),
                "pdserve.decode.member": getattr(info, "decode", None),
                "pdserve.resumes": getattr(info, "retries", None),
            }
        )
        if outcome != "ok":
            self.trace.set_error(outcome)
        self.trace.end()

    def _on_token(self, info: RequestInfo | None) -> None:
        now = time.monotonic()
        if self.first_token is None:
            self.first_token = now
        self.last_token = now
        self.completion_tokens += 1
        if info is not None:
            self.info = info
