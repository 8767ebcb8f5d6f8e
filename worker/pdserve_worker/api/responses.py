"""The response writers: one JSON body, or a stream of server-sent events in OpenAI's chunks.

- a stream's headers are sent only once the first token exists, so a backend that has no
  capacity still gets a real 429 with Retry-After rather than an error inside a 200 stream;
- a client that goes away cancels the backend's generator, streaming or not, so its decode
  slot is released at once instead of after the answer would have been complete;
- error bodies name no worker and no gRPC detail: the client reads a generic message with
  the request id, the router's log has the details under that id;
- with an admission queue, a request waits for its turn before its first attempt, and the
  backend's `NoCapacity` before the first token sends it back to its place (api/admission.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from pdserve_common import tracing
from pdserve_common.logs import kv
from pdserve_worker.api import prompt_copies
from pdserve_worker.api.admission import AdmissionQueue, Rejected, State
from pdserve_worker.api.backend import BackendError, NoCapacity, capacity_listener
from pdserve_worker.api.errors import ApiError, from_backend_error, from_rejection
from pdserve_worker.api.generation import Delta, Generation
from pdserve_worker.api.ledger import Ledger
from pdserve_worker.api.logprobs import Scored, TokenText
from pdserve_worker.api.response_format import ResponseFormat, Usage

log = logging.getLogger(__name__)
T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before the answer was ready."""


async def run_unless_disconnected(request: Request, fn: Callable[[], Awaitable[T]]) -> T:
    """Await `fn()`, cancelling it if the client disconnects meanwhile.

    The body has been read by then, so the next ASGI message can only be `http.disconnect`;
    a watcher task waits for it and cancels the work, which unwinds through the backend's
    generator (its `finally` frees the slot).
    """
    disconnected = False
    failure: Exception | None = None
    result: T | None = None
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            nonlocal disconnected
            while (await request.receive())["type"] != "http.disconnect":
                pass
            disconnected = True
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        try:
            result = await fn()
        except Exception as exc:  # kept out of the task group, which would wrap it in a group
            failure = exc
        tg.cancel_scope.cancel()
    if disconnected:
        raise ClientDisconnected()
    if failure is not None:
        raise failure
    return result  # type: ignore[return-value]  # set whenever fn() returned


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always closes its generators when the response ends.

    Starlette stops iterating the body when the client disconnects but leaves the generator
    suspended; it would hold the backend's slot until garbage collection. Closing here runs
    the generators' cleanup (and so the backend's) as soon as the response is over.
    """

    def __init__(
        self, content: AsyncIterator[str], closers: list[Callable[[], Awaitable[None]]], headers: dict[str, str]
    ) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._closers = closers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.close()

    async def close(self) -> None:
        """Run the closers, once (also for a stream that is never sent: api/fan_out.py)."""
        closers, self._closers = self._closers, []
        for close in closers:
            await close()


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n"


class ResponseWriter:
    """Answers an admitted request: waits for its first token, then writes the body or the stream."""

    def __init__(
        self,
        admission: AdmissionQueue | None,
        report_request_info: bool,
        token_texts: TokenText | None,
    ) -> None:
        self.admission = admission
        self.report_request_info = report_request_info
        self.token_texts = token_texts

    def _extension(self, gen: Generation) -> dict[str, Any] | None:
        if not self.report_request_info or gen.info is None:
            return None
        return gen.info.as_response_field(workers=gen.show_workers)

    def _usage(self, gen: Generation) -> Usage:
        cached = gen.info.cached_tokens if gen.info is not None else 0
        return Usage(prompt_tokens=gen.prompt_tokens, completion_tokens=gen.completion_tokens, cached_tokens=cached)

    def _fail(self, exc: BaseException, ledger: Ledger) -> ApiError:
        """Account a failed request and return the error to answer with; the details (worker
        names, gRPC status) go to the log under the request id, not to the client."""
        request_id = ledger.request_id
        if isinstance(exc, Rejected):  # its deadline passed while it waited for admission
            log.info(kv(event="request_rejected", request_id=request_id, reason=exc.reason.value))
            ledger.rejected(exc.reason.value)
            error = from_rejection(exc, request_id)
            error.headers.setdefault("x-request-id", request_id)
            return error
        if isinstance(exc, BackendError):
            error, reason = from_backend_error(exc, request_id)
            log.warning(kv(event="request_failed", request_id=request_id, reason=reason, error=str(exc)))
        else:
            log.error(kv(event="request_error", request_id=request_id, error=repr(exc)), exc_info=exc)
            error, reason = ApiError(500, f"internal error (request {request_id})", "internal_error"), "internal"
        ledger.failed(reason)
        error.headers.setdefault("x-request-id", request_id)
        return error

    async def _first(self, gen: Generation, ledger: Ledger) -> tuple[AsyncGenerator[Delta, None], Delta]:
        """The request's deltas and the first of them, once admitted.

        Without an admission queue the backend's `NoCapacity` is the client's 429. With one,
        the request waits for its turn, then tries; a `NoCapacity` before the reservation puts
        it back at its place, to try again when the queue says (api/admission.py).
        """
        try:
            return await self._first_admitted(gen, ledger)
        finally:
            prompt_copies.first_done()  # the first copy of a prompt: the others may go

    async def _first_admitted(self, gen: Generation, ledger: Ledger) -> tuple[AsyncGenerator[Delta, None], Delta]:
        ticket, admission = ledger.ticket, self.admission
        while True:
            if ticket is not None and admission is not None:
                queued_ns = tracing.now_ns()
                await admission.wait_turn(ticket)
                tracing.record("router.queue", queued_ns, tracing.now_ns(), parent=gen.trace)
            deltas = gen.deltas()
            try:
                if ticket is None or admission is None:
                    return deltas, await deltas.__anext__()
                with capacity_listener(lambda: admission.held(ticket)):
                    first = await deltas.__anext__()
                admission.held(ticket)  # a backend that never reports it: the first token proves it
                return deltas, first
            except NoCapacity:
                await deltas.aclose()
                if ticket is None or admission is None or ticket.state is not State.TRYING:
                    raise
                admission.no_capacity(ticket)
            except BaseException:
                await deltas.aclose()
                raise

    async def complete(self, request: Request, gen: Generation, fmt: ResponseFormat, ledger: Ledger) -> Response:
        scored: list[Scored] = []

        parts: list[str] = []

        def take(delta: Delta) -> None:
            parts.append(delta.text)
            if delta.scored is not None:
                scored.append(delta.scored)

        async def collect() -> str:
            deltas, first = await self._first(gen, ledger)
            take(first)
            if first.finish_reason is None:
                async for delta in deltas:
                    take(delta)
            return "".join(parts)

        try:
            text = await run_unless_disconnected(request, collect)
        except ClientDisconnected:
            ledger.failed("cancelled")
            return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
        except asyncio.CancelledError:  # the server gave up on us (shutdown past its grace period)
            ledger.failed("cancelled")
            raise
        except Exception as exc:
            raise self._fail(exc, ledger) from None
        assert gen.finish_reason is not None
        ledger.completed()
        if fmt.echo is not None:
            text, scored = fmt.echo + text, gen.echoed() + scored
        body = fmt.full(text, gen.finish_reason, self._usage(gen), self._extension(gen), scored)
        if fmt.prompt_logprobs and self.token_texts is not None:
            fmt.add_prompt_logprobs(body, gen.echoed(), self.token_texts)
        return JSONResponse(body, headers={"x-request-id": gen.request_id})

    async def stream(self, request: Request, gen: Generation, fmt: ResponseFormat, ledger: Ledger) -> Response:
        try:  # (`_first` closes the deltas of any attempt that does not return)
            deltas, first = await run_unless_disconnected(request, lambda: self._first(gen, ledger))
        except ClientDisconnected:
            ledger.failed("cancelled")
            return Response(status_code=499)
        except asyncio.CancelledError:
            ledger.failed("cancelled")
            raise
        except Exception as exc:
            raise self._fail(exc, ledger) from None
        events = self._events(gen, fmt, first, deltas, ledger)

        async def abandon() -> None:
            ledger.failed("cancelled")  # no-op when the stream was already accounted

        return ClosingStreamingResponse(
            events,
            closers=[events.aclose, deltas.aclose, abandon],
            headers={"x-request-id": gen.request_id, "Cache-Control": "no-cache"},
        )

    async def _events(
        self, gen: Generation, fmt: ResponseFormat, first: Delta, deltas: AsyncIterator[Delta], ledger: Ledger
    ) -> AsyncGenerator[str, None]:
        """The SSE body: opening chunks, one chunk per visible delta, finish, usage, [DONE]."""
        try:
            for chunk in fmt.opening_chunks():
                yield sse(chunk)
            if fmt.echo is not None:
                echoed = fmt.text_chunk(fmt.echo, gen.echoed())
                if echoed is not None:
                    yield sse(echoed)
            delta = first
            while True:
                if delta.text or delta.scored is not None:
                    piece = fmt.text_chunk(delta.text, () if delta.scored is None else (delta.scored,))
                    if piece is not None:  # (None: held back, e.g. what may be a tool call)
                        yield sse(piece)
                if delta.finish_reason is not None:
                    for closing in fmt.closing_chunks():
                        yield sse(closing)
                    yield sse(fmt.finish_chunk(delta.finish_reason, self._extension(gen)))
                    break
                delta = await anext(deltas)
            if fmt.include_usage:
                yield sse(fmt.usage_chunk(self._usage(gen)))
        except (asyncio.CancelledError, GeneratorExit):
            ledger.failed("cancelled")
            raise
        except Exception as exc:
            # Headers are gone: report in-band as OpenAI does, then end the stream cleanly.
            error = self._fail(exc, ledger)
            yield sse(error.body())
            yield sse("[DONE]")
            return
        yield sse("[DONE]")
        ledger.completed()
