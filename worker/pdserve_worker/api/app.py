"""The router's OpenAI-compatible HTTP API over an abstract `Backend`.

`create_app(backend, metrics)` serves `/v1/completions` and `/v1/chat/completions` (streaming
as server-sent events in OpenAI's chunk format, or one JSON body with `usage`), `/v1/models`,
`/health` and `/metrics`. Everything topology-specific (which decode, which slot, the KV
push) is behind the backend; this module owns the HTTP contract:

- bad input is a 4xx with OpenAI's error envelope, decided before the backend is called;
- a stream's headers are sent only once the first token exists, so a backend that has no
  capacity still gets a real 429 with Retry-After rather than an error inside a 200 stream;
- a client that goes away cancels the backend's generator, streaming or not, so its decode
  slot is released at once instead of after the answer would have been complete;
- every input is bounded before it costs anything (`RouterLimits`): the body's size (413
  before it is read, from Content-Length, or as soon as a chunked body passes the limit), the
  fields (openai_api.py), the prompt's characters (before tokenizing), and tokenizing itself
  runs in a small thread pool with a bounded queue (api/tokenizing.py);
- error bodies name no worker and no gRPC detail: the client reads a generic message with
  the request id, the router's log has the details under that id;
- with API keys (`keys`), every /v1 route needs `Authorization: Bearer KEY` (401 otherwise);
  with an admission queue (`admission`), a request waits there for its KV reservation instead
  of being answered 429 when no slot is free (api/admission.py): the backend's `NoCapacity`
  before the first token sends it back to its place in the queue.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from pdserve_common import tracing
from pdserve_common.channels import WORKER_MAX_MESSAGE
from pdserve_common.logs import kv
from pdserve_worker import __version__
from pdserve_worker.api import fan_out, prompt_copies
from pdserve_worker.api import tools as api_tools
from pdserve_worker.api.admission import AdmissionQueue, Rejected, State, Ticket
from pdserve_worker.api.backend import Backend, BackendError, InvalidPrompt, NoCapacity, capacity_listener
from pdserve_worker.api.bad_words import BadWordsError, bad_word_ids
from pdserve_worker.api.cache_scope import cache_scope
from pdserve_worker.api.errors import (
    ApiError,
    from_backend_error,
    from_rejection,
    from_validation_errors,
    retry_headers,
    unauthorized,
)
from pdserve_worker.api.generation import Delta, Generation
from pdserve_worker.api.grammar_compiler import (
    BudgetSpent,
    FieldGrammarError,
    GrammarCompiler,
    GrammarLimits,
    grammar_check,
)
from pdserve_worker.api.keys import ANONYMOUS, PRIORITIES, KeyFile, KeyStore, Tenant, TenantLimits, bearer_key
from pdserve_worker.api.logprobs import Scored, TokenText
from pdserve_worker.api.metrics import RouterMetrics
from pdserve_worker.api.openai_api import (
    ChatCompletionRequest,
    ChatResponseFormat,
    CompletionRequest,
    DetokenizeRequest,
    ResponseFormat,
    TokenizeRequest,
    Usage,
    error_body,
    system_fingerprint,
)
from pdserve_worker.api.tokenizing import (
    TOKENIZE_QUEUE,
    TOKENIZE_THREADS,
    TokenizerPool,
    max_prompt_chars,
)
from pdserve_worker.model.sampling.grammar import GrammarError
from pdserve_worker.model.sampling.params import SamplingParams

# Bytes one (token id, logprob) pair takes in the prefill's reply, generously (proto: varint + double + tags).
PROMPT_LOGPROB_BYTES = 16

log = logging.getLogger("pdserve.router")
INLINE_DETOKENIZE_MAX_IDS = 512
T = TypeVar("T")

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat fills the context
INLINE_TOKENIZE_MAX_CHARS = 2048  # longer prompts are tokenized in a worker thread
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEBUG_HEADER = "x-pdserve-debug"  # "workers": name the prefill and decode in the response
PRIORITY_HEADER = "x-pdserve-priority"  # high | normal | low, capped by the key's maxPriority
DEADLINE_HEADER = "x-pdserve-deadline-ms"  # how long the request may wait for admission (only shortens)
DEFAULT_PRIORITY = "normal"
ANONYMOUS_TENANT = Tenant(ANONYMOUS, TenantLimits())


@dataclass(frozen=True)
class RouterLimits:
    """Bounds of what one request may cost the router (README "Limits")."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger bodies are answered 413 unread
    max_prompt_chars: int | None = None  # None: what can fit the context (tokenizing.max_prompt_chars)
    tokenize_threads: int = TOKENIZE_THREADS
    tokenize_queue: int = TOKENIZE_QUEUE  # long prompts tokenizing or waiting; past it, 429
    grammar: GrammarLimits = GrammarLimits()  # structured outputs' and tools' compiling


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


class _Ledger:
    """Accounts one admitted request exactly once in metrics and in the log, however it ends."""

    def __init__(
        self,
        metrics: RouterMetrics,
        gen: Generation,
        endpoint: str,
        admission: AdmissionQueue | None = None,
        ticket: Ticket | None = None,
    ) -> None:
        self._metrics = metrics
        self._gen = gen
        self._endpoint = endpoint
        self._admission = admission
        self.ticket = ticket
        self.closed = False

    @property
    def request_id(self) -> str:
        return self._gen.request_id

    def completed(self) -> None:
        if self._close("ok"):
            self._metrics.observe_completed(self._gen.timing(), self._gen.prompt_tokens, self._gen.info)

    def failed(self, reason: str) -> None:
        if self._close(reason):
            self._metrics.observe_failed(reason, self._gen.timing(), self._gen.prompt_tokens)

    def rejected(self, reason: str) -> None:
        """The admission queue refused the request while it waited (its deadline passed)."""
        if self._close(reason):
            self._metrics.observe_rejected(429)

    def _close(self, outcome: str) -> bool:
        if self.closed:
            return False
        self.closed = True
        if self._admission is not None and self.ticket is not None:
            # The one release of the request's admission, however it ended.
            self._admission.release(self.ticket, self._gen.completion_tokens)
        self._gen.end_trace(outcome)
        if not log.isEnabledFor(logging.INFO):
            return True
        gen, timing = self._gen, self._gen.timing()
        info = gen.info
        log.info(
            kv(
                event="request_done",
                request_id=gen.request_id,
                endpoint=self._endpoint,
                outcome=outcome,
                prompt_tokens=gen.prompt_tokens,
                completion_tokens=gen.completion_tokens,
                finish_reason=gen.finish_reason,
                ttft_ms=None if timing.ttft_s is None else round(timing.ttft_s * 1000, 2),
                e2e_ms=round(timing.e2e_s * 1000, 2),
                disaggregated=info is not None and info.disaggregated,
                kv_bytes=0 if info is None else info.kv_bytes,
            )
        )
        return True


class _ClosingStreamingResponse(StreamingResponse):
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


def _chars(value: Any) -> int:
    """Characters of a value as JSON (0 for nothing)."""
    return len(json.dumps(value, ensure_ascii=False)) if value else 0


def _sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n"


def too_large(limit: int) -> JSONResponse:
    body = error_body(f"request body is larger than the limit of {limit} bytes", code="request_too_large")
    # The rest of the body is not read: the connection cannot be reused.
    return JSONResponse(body, status_code=413, headers={"Connection": "close"})


KEYED_PATHS = ("/tokenize", "/detokenize")  # keyed like /v1 (vLLM serves them at the root)


def _keyed(path: str) -> bool:
    return path.startswith("/v1/") or path in KEYED_PATHS


class KeysFirst:
    """ASGI middleware: with API keys on, a /v1 (or /tokenize, /detokenize) request without a known key is answered 401
    before anything else looks at it. FastAPI reads and JSON-decodes the body before it runs
    the endpoint's dependencies, so invalid JSON without a key got 400 (and its field errors)
    before 401; docs/admission.md says keys come first. The endpoints' own dependency still
    finds the tenant (the lookup is a dict access)."""

    def __init__(self, app: Any, authenticate: Callable[[Request], Tenant]) -> None:
        self.app = app
        self.authenticate = authenticate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _keyed(str(scope.get("path", ""))):
            try:
                self.authenticate(Request(scope))
            except ApiError as exc:
                await JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _BodyTooLarge(StarletteHTTPException):
    def __init__(self) -> None:
        super().__init__(413, "request body too large")


class BodyLimit:
    """ASGI middleware: a body larger than `max_bytes` is answered 413 in OpenAI's error shape.

    With a Content-Length over the limit the answer goes out before a byte of the body is read;
    a chunked body is counted as it arrives and refused the moment it passes the limit (the
    endpoint's body read raises, FastAPI's handlers answer). Written here rather than FastAPI's
    `max_body_size` because that one answers a Content-Length over the limit in text/plain,
    which OpenAI clients cannot read as an error.
    """

    def __init__(self, app: Any, max_bytes: int, metrics: RouterMetrics) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), None)
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            self.metrics.observe_rejected(413)
            await too_large(self.max_bytes)(scope, receive, send)
            return
        seen = 0

        async def counted() -> Any:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _BodyTooLarge()
            return message

        await self.app(scope, counted, send)


class _Router:
    """The request path shared by both generation endpoints."""

    def __init__(
        self,
        backend: Backend,
        metrics: RouterMetrics,
        report_request_info: bool,
        limits: RouterLimits,
        admission: AdmissionQueue | None = None,
        keys: KeyFile | KeyStore | None = None,
        sampling_defaults: Mapping[str, float | int] | None = None,
    ) -> None:
        self.backend = backend
        self.sampling_defaults = dict(sampling_defaults or {})
        self.admission = admission
        self.keys = keys
        self.metrics = metrics
        self.report_request_info = report_request_info
        self.limits = limits
        self.tokenizers = TokenizerPool(limits.tokenize_threads, limits.tokenize_queue)
        self.grammars = GrammarCompiler(limits.grammar, compile_one=grammar_check(backend))
        self.fingerprint = system_fingerprint(backend.model_name, backend.revision)
        decode = backend.detokenize  # a backend without a tokenizer reports no logprobs
        self.token_texts = None if decode is None else TokenText(decode)
        self.max_prompt_chars = limits.max_prompt_chars or max_prompt_chars(
            backend.max_model_len, backend.max_token_chars
        )

    def reject(self, status: int, message: str, param: str | None = None, code: str | None = None) -> ApiError:
        self.metrics.observe_rejected(status)
        return ApiError(status, message, param=param, code=code)

    def authenticate(self, request: Request) -> Tenant:
        """The request's tenant by its bearer key; 401 without a known key (keys configured)."""
        if self.keys is None:
            return ANONYMOUS_TENANT
        key = bearer_key(request.headers.get("authorization"))
        tenant = None if key is None else self.keys.lookup(key)
        if tenant is None:
            self.metrics.observe_rejected(401)
            raise unauthorized(presented=key is not None)
        return tenant

    def _admission_headers(self, request: Request) -> tuple[str, float | None]:
        """The priority class and the deadline (seconds) a request asks for in its headers."""
        priority = request.headers.get(PRIORITY_HEADER, DEFAULT_PRIORITY).strip().lower()
        if priority not in PRIORITIES:
            raise self.reject(
                400,
                f"header {PRIORITY_HEADER}: {priority[:32]!r} is not one of {', '.join(PRIORITIES)}",
                code="invalid_priority",
            )
        raw = request.headers.get(DEADLINE_HEADER)
        if raw is None:
            return priority, None
        raw = raw.strip()
        if not (raw.isascii() and raw.isdigit() and len(raw) <= 8) or not 0 < int(raw) <= 86_400_000:
            raise self.reject(
                400,
                f"header {DEADLINE_HEADER}: {raw[:32]!r} is not a whole number of milliseconds from 1 to 86400000",
                code="invalid_deadline",
            )
        return priority, int(raw) / 1000.0

    async def serve(
        self, request: Request, body: CompletionRequest | ChatCompletionRequest, tenant: Tenant = ANONYMOUS_TENANT
    ) -> Response:
        if body.sequences() > 1:
            return await self._serve_prompts(request, body, tenant)
        arrived = time.monotonic()
        chat = isinstance(body, ChatCompletionRequest)
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        # The request's span: a child of the caller's `traceparent` if it sent one. The ledger
        # ends it once the request is accounted; a request refused before that ends it here.
        trace = tracing.start_span(
            "router.request",
            {
                "pdserve.request_id": request_id,
                "http.route": request.url.path,
                "gen_ai.request.model": self.backend.model_name,
                "pdserve.stream": bool(body.stream),
            },
            parent=tracing.extract(request.headers),
        )
        try:
            with tracing.use(trace):
                return await self._serve(request, body, tenant, chat, request_id, arrived, trace)
        except BaseException as exc:
            trace.record_exception(exc)
            trace.end()
            raise

    async def _serve_prompts(
        self, request: Request, body: CompletionRequest | ChatCompletionRequest, tenant: Tenant
    ) -> Response:
        """Several prompts or n > 1: each sequence a request of its own, all at once, joined
        (api/fan_out.py)."""
        n = body.n or 1
        parts = body.split()
        calls: list[Callable[[], Awaitable[Response]]]
        if n > 1 and self.backend.shares_prompt_prefill:  # (api/prompt_copies.py)
            groups = [prompt_copies.Copies(later=n - 1) for _ in range(len(parts) // n)]
            calls = [
                functools.partial(self._serve_copy, request, part, tenant, groups[k // n], k % n == 0)
                for k, part in enumerate(parts)
            ]
        else:
            calls = [functools.partial(self.serve, request, part, tenant) for part in parts]
        responses = await fan_out.run_all(calls)
        if not body.stream:
            return fan_out.full_response(responses, n)
        streams = [r for r in responses if isinstance(r, _ClosingStreamingResponse)]
        if len(streams) < len(responses):  # one was not a stream (a 499: the client left)
            for stream in streams:
                await stream.close()
            return next(r for r in responses if not isinstance(r, _ClosingStreamingResponse))
        request_id = streams[0].headers["x-request-id"]
        merged = fan_out.merged_stream(streams, body.include_usage_chunk, request_id, n)
        return _ClosingStreamingResponse(
            merged,
            closers=[merged.aclose, *(s.close for s in streams)],
            headers={"x-request-id": request_id, "Cache-Control": "no-cache"},
        )

    async def _serve_copy(
        self,
        request: Request,
        body: CompletionRequest | ChatCompletionRequest,
        tenant: Tenant,
        copies: prompt_copies.Copies,
        first: bool,
    ) -> Response:
        """One copy of a prompt (its own task: the group is this task's context)."""
        prompt_copies.enter(copies, first)
        try:
            return await self.serve(request, body, tenant)
        finally:
            prompt_copies.first_done()  # (a no-op but for the first copy; already done once it had a token)

    async def _serve(
        self,
        request: Request,
        body: CompletionRequest | ChatCompletionRequest,
        tenant: Tenant,
        chat: bool,
        request_id: str,
        arrived: float,
        trace: Any,
    ) -> Response:
        priority, deadline_s = self._admission_headers(request)
        with tracing.span("router.admission") as admission:  # model, tokenize, limits, sampling parameters
            prompt_ids, params, max_tokens = await self._admit(body, chat, request_id, tenant)
            admission.set_attribute("gen_ai.usage.input_tokens", len(prompt_ids))
        served = PRIORITIES[max(PRIORITIES.index(priority), PRIORITIES.index(tenant.limits.max_priority))]
        trace.set_attributes(
            {
                "gen_ai.usage.input_tokens": len(prompt_ids),
                "gen_ai.request.max_tokens": max_tokens,
                "pdserve.tenant": tenant.name,
                # The class it is served in (the key's maxPriority caps what it asked for).
                "pdserve.priority": served,
                "pdserve.priority.requested": priority,
            }
        )
        gen = Generation(
            self.backend,
            prompt_ids,
            params,
            request_id,
            arrived,
            trace=trace,
            cache_scope=cache_scope(tenant, body.cache_salt),
        )
        gen.show_workers = self._shows_workers(request, tenant)
        fmt = self._response_format(body, request_id, params)
        await prompt_copies.wait_for_first()  # a later copy of a prompt: after the first one's prefill
        ticket = self._ticket(tenant, priority, len(prompt_ids), max_tokens, deadline_s, request_id)
        # No await between the ticket and the ledger that releases it.
        ledger = _Ledger(self.metrics, gen, "chat" if chat else "completions", self.admission, ticket)
        if body.stream:
            return await self._stream(request, gen, fmt, ledger)
        return await self._complete(request, gen, fmt, ledger)

    def _response_format(
        self, body: CompletionRequest | ChatCompletionRequest, request_id: str, params: SamplingParams
    ) -> ResponseFormat:
        asked = body.prompt_logprobs is not None
        token_text = None if params.logprobs is None else self.token_texts
        if isinstance(body, ChatCompletionRequest):
            return ChatResponseFormat(
                request_id=request_id,
                model=self.backend.model_name,
                include_usage=body.include_usage_chunk,
                token_text=token_text,
                fingerprint=self.fingerprint,
                prompt_logprobs=asked,
                tools=body.tool_spec,
                tool_format=self._tool_format(),
            )
        return ResponseFormat(
            request_id=request_id,
            model=self.backend.model_name,
            include_usage=body.include_usage_chunk,
            token_text=token_text,
            echo=self._echo_text(body),
            fingerprint=self.fingerprint,
            prompt_logprobs=asked,
        )

    def _tool_format(self) -> api_tools.Format:
        """The format the model calls tools in (its template's); hermes for a backend without one."""
        return "llama3_json" if self.backend.tool_format == "llama3_json" else "hermes"

    def _echo_text(self, body: CompletionRequest | ChatCompletionRequest) -> str | None:
        """The prompt as the response repeats it (`echo`): as sent, or its ids decoded."""
        if not isinstance(body, CompletionRequest) or not body.echo:
            return None
        ids = body.prompt_ids
        if ids is None:
            return body.prompt_text
        if self.token_texts is None:
            raise self.reject(400, "this backend cannot decode token ids: echo is not available", param="echo")
        return self.token_texts.decode(ids)

    def _ticket(
        self,
        tenant: Tenant,
        priority: str,
        prompt_tokens: int,
        max_tokens: int,
        deadline_s: float | None,
        request_id: str,
    ) -> Ticket | None:
        """The request's place in the admission queue (None without one); a 429 when refused."""
        if self.admission is None:
            return None
        try:
            return self.admission.enter(tenant, priority, prompt_tokens, max_tokens, deadline_s)  # type: ignore[arg-type]
        except Rejected as exc:
            self.metrics.observe_rejected(429)
            log.info(
                kv(
                    event="request_rejected",
                    request_id=request_id,
                    tenant=tenant.name,
                    reason=exc.reason.value,
                    retry_after_s=round(exc.retry_after_s, 3),
                )
            )
            raise from_rejection(exc, request_id) from None

    async def _grammar(
        self, body: CompletionRequest | ChatCompletionRequest, tenant: Tenant, request_id: str
    ) -> str | None:
        """The grammar the output must match (its structured-output field's, or the one tool_choice
        required or named enforces), compiled off the event loop with the tools' schemas
        (api/grammar_compiler.py); a 400 naming the field it cannot serve, a 429 past the
        tenant's compile time or the compiler's queue."""
        spec = body.tool_spec if isinstance(body, ChatCompletionRequest) else None
        try:
            forced = spec.grammar(self._tool_format()) if spec is not None else None
        except GrammarError as exc:
            raise self.reject(400, f"tool_choice: {exc}", param="tool_choice") from None
        asked = forced or body.grammar
        asks = [*(spec.asks() if spec is not None else []), *([asked] if asked is not None else [])]
        if not asks:
            return None
        try:
            compiled = await self.grammars.compile(asks, tenant.name)
        except FieldGrammarError as exc:
            raise self.reject(400, f"{exc.field}: {exc}", param=exc.field.split("[")[0]) from None
        except BudgetSpent as exc:
            log.info(kv(event="grammar_budget_spent", request_id=request_id, tenant=tenant.name, status=exc.status))
            if exc.status == 429:
                self.metrics.observe_rejected(429)
                raise ApiError(
                    429, str(exc), "rate_limit_error", None, "grammar_budget_exceeded", retry_headers(exc.retry_after_s)
                ) from None
            raise self.reject(400, str(exc), param=exc.field.split("[")[0], code="grammar_budget_exceeded") from None
        except NoCapacity as exc:
            error, _ = from_backend_error(exc, request_id)
            self.metrics.observe_rejected(error.status)
            raise error from None
        return compiled[-1] if asked is not None else None

    async def _admit(
        self, body: CompletionRequest | ChatCompletionRequest, chat: bool, request_id: str, tenant: Tenant
    ) -> tuple[list[int], SamplingParams, int]:
        """The prompt's token ids, the sampling parameters and max_tokens; an ApiError (4xx) if
        the request cannot be served as asked."""
        self._check_model(body.model)
        prompt_ids = await self._tokenize(body, request_id)
        prompt_field = "messages" if chat else "prompt"
        if not prompt_ids:
            raise self.reject(400, f"{prompt_field} is empty (0 tokens)", param=prompt_field)
        max_field = (
            "max_completion_tokens"
            if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None
            else "max_tokens"
        )
        max_tokens = self._settle_max_tokens(
            body.requested_max_tokens(),
            None if chat else COMPLETIONS_DEFAULT_MAX_TOKENS,
            len(prompt_ids),
            prompt_field,
            max_field,
        )
        if body.logit_bias:  # ids past the vocabulary are the client's mistake (a 400), as in a prompt of ids
            self._checked_ids([int(k) for k in body.logit_bias], "logit_bias")
        grammar = await self._grammar(body, tenant, request_id)
        try:
            params = body.sampling_params(max_tokens, self.sampling_defaults, self._bad_words(body), grammar)
        except ValidationError as exc:
            self.metrics.observe_rejected(400)
            raise from_validation_errors(exc.errors()) from None
        if (params.logprobs is not None or params.prompt_logprobs is not None) and self.token_texts is None:
            raise self.reject(400, "this backend cannot name tokens: logprobs are not available", param="logprobs")
        if params.prompt_logprobs is not None:
            # The prefill sends them in one gRPC reply: bounded, with room to spare, by its message limit.
            most = WORKER_MAX_MESSAGE // 2 // (PROMPT_LOGPROB_BYTES * (params.prompt_logprobs + 1))
            if len(prompt_ids) > most:
                raise self.reject(
                    400,
                    f"prompt logprobs with {params.prompt_logprobs} alternatives are served for prompts of at most {most} tokens, "
                    f"got {len(prompt_ids)}: ask fewer alternatives or no echo",
                    param="logprobs",
                )
        return prompt_ids, params, max_tokens

    def _bad_words(self, body: CompletionRequest | ChatCompletionRequest) -> tuple[tuple[int, ...], ...]:
        """The request's bad_words as token sequences (api/bad_words.py); 400 if one cannot be."""
        if not body.bad_words:
            return ()
        encode = self.backend.encode_words
        if encode is None:
            raise self.reject(400, "this backend has no tokenizer: bad_words are not available", param="bad_words")
        try:
            return bad_word_ids(body.bad_words, encode)
        except BadWordsError as exc:
            raise self.reject(400, str(exc), param="bad_words") from None

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        """vLLM's /tokenize: the prompt's (or conversation's) token ids as a request would get them."""
        self._check_model(body.model)
        if body.messages is not None:
            as_request: CompletionRequest | ChatCompletionRequest = ChatCompletionRequest(
                model=body.model, messages=body.messages
            )
        else:
            as_request = CompletionRequest(model=body.model, prompt=body.prompt or "")
        ids = await self._tokenize(as_request, "tokenize")
        return {"count": len(ids), "max_model_len": self.backend.max_model_len, "tokens": ids}

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        """vLLM's /detokenize."""
        self._check_model(body.model)
        ids = self._checked_ids(body.tokens, "tokens")
        decode = self.backend.detokenize
        if decode is None:
            raise self.reject(400, "this backend cannot detokenize", param="tokens")
        # A context's worth of ids may take a while: off the event loop past a short one.
        if len(ids) <= INLINE_DETOKENIZE_MAX_IDS:
            return {"prompt": decode(ids)}
        return {"prompt": await self.tokenizers.run(lambda: decode(ids))}

    def _check_model(self, model: str) -> None:
        if model != self.backend.model_name:
            raise self.reject(
                404,
                f"The model '{model}' does not exist; this server serves '{self.backend.model_name}'",
                param="model",
                code="model_not_found",
            )

    def _checked_ids(self, ids: list[int], field: str) -> list[int]:
        """Token ids a client sent: no more than a context holds (checked first: the scan below
        is per id), each one the model's tokenizer knows."""
        limit = self.backend.max_model_len
        if len(ids) > limit:
            raise self.reject(
                400,
                f"{field} is {len(ids)} tokens, more than the model's maximum context length of {limit} tokens",
                param=field,
                code="context_length_exceeded",
            )
        vocab = self.backend.vocab_size  # a backend without a tokenizer: the workers check
        if vocab is None:
            return ids
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise self.reject(400, f"{field}: token id {bad} is out of the vocabulary (0..{vocab - 1})", param=field)
        return ids

    async def _tokenize(self, body: CompletionRequest | ChatCompletionRequest, request_id: str) -> list[int]:
        """Token ids of the prompt; a prompt too long to fit is refused by its length in
        characters, before it is tokenized; long prompts are tokenized off the event loop.

        A thread hop costs about 0.2-2 ms here (benchmarks/router_overhead.py), more than
        tokenizing a short prompt, so short ones run inline; a long prompt must not stall
        the streams that share the loop.
        """
        if isinstance(body, CompletionRequest) and body.prompt_ids is not None:
            return self._checked_ids(body.prompt_ids, "prompt")
        if isinstance(body, ChatCompletionRequest):
            try:
                messages = [m.template_dict() for m in body.messages]
            except ValueError as exc:  # an earlier turn's tool call whose arguments are not JSON
                raise self.reject(400, f"messages: {exc}", param="messages") from None
            spec = body.tool_spec
            tools = spec.template_tools() if spec is not None else None
            # the template writes the tools and earlier calls too: they count towards the prompt's size
            size = (
                sum(len(m["content"]) for m in messages)
                + _chars(tools)
                + _chars([m["tool_calls"] for m in messages if "tool_calls" in m])
            )
            call: Callable[[], list[int]] = (
                (lambda: self.backend.tokenize_chat(messages, tools=tools))  # type: ignore[call-arg]
                if tools
                else (lambda: self.backend.tokenize_chat(messages))
            )
            field = "messages"
        else:
            text = body.prompt_text
            size = len(text)
            call = lambda: self.backend.tokenize_prompt(text)  # noqa: E731
            field = "prompt"
        if size > self.max_prompt_chars:
            raise self.reject(
                400,
                f"{field} is {size} characters; at most {self.max_prompt_chars} can fit the model's maximum "
                f"context length of {self.backend.max_model_len} tokens",
                param=field,
                code="context_length_exceeded",
            )
        try:
            if size <= INLINE_TOKENIZE_MAX_CHARS:
                return call()
            return await self.tokenizers.run(call)
        except BackendError as exc:
            if isinstance(exc, InvalidPrompt):
                exc.public = True  # a tokenizer's refusal is about the client's own input
            error, _ = from_backend_error(exc, request_id)
            self.metrics.observe_rejected(error.status)
            raise error from None

    def _settle_max_tokens(
        self, requested: int | None, default: int | None, prompt_len: int, prompt_field: str, max_field: str
    ) -> int:
        """The number of tokens to generate, within the model's context; 400 if it cannot fit."""
        limit = self.backend.max_model_len
        room = limit - prompt_len
        if room < 1:
            raise self.reject(
                400,
                f"{prompt_field} is {prompt_len} tokens, but the model's maximum context length is {limit} "
                f"tokens, which must also hold at least one generated token",
                param=prompt_field,
                code="context_length_exceeded",
            )
        if requested is None:
            return room if default is None else min(default, room)
        if requested > room:
            raise self.reject(
                400,
                f"{prompt_field} ({prompt_len} tokens) plus {max_field} ({requested}) is "
                f"{prompt_len + requested} tokens, more than the model's maximum context length of {limit} "
                f"tokens; ask for at most {room}",
                param=max_field,
                code="context_length_exceeded",
            )
        return requested

    def _extension(self, gen: Generation) -> dict[str, Any] | None:
        if not self.report_request_info or gen.info is None:
            return None
        return gen.info.as_response_field(workers=gen.show_workers)

    def _shows_workers(self, request: Request, tenant: Tenant) -> bool:
        """The debug header asks for the workers' names; a key may allow it (`debug: true` in
        keys.yaml), and without keys (no authentication at all) anyone may."""
        asked = "workers" in request.headers.get(DEBUG_HEADER, "").lower().replace(" ", "").split(",")
        return asked and (self.keys is None or tenant.limits.debug)

    def _usage(self, gen: Generation) -> Usage:
        cached = gen.info.cached_tokens if gen.info is not None else 0
        return Usage(prompt_tokens=gen.prompt_tokens, completion_tokens=gen.completion_tokens, cached_tokens=cached)

    def _fail(self, exc: BaseException, ledger: _Ledger) -> ApiError:
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

    async def _first(self, gen: Generation, ledger: _Ledger) -> tuple[AsyncGenerator[Delta, None], Delta]:
        """The request's deltas and the first of them, once admitted.

        Without an admission queue the backend's `NoCapacity` is the client's 429. With one,
        the request waits for its turn, then tries; a `NoCapacity` before the reservation puts
        it back at its place, to try again when the queue says (api/admission.py).
        """
        try:
            return await self._first_admitted(gen, ledger)
        finally:
            prompt_copies.first_done()  # the first copy of a prompt: the others may go

    async def _first_admitted(self, gen: Generation, ledger: _Ledger) -> tuple[AsyncGenerator[Delta, None], Delta]:
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

    async def _complete(self, request: Request, gen: Generation, fmt: ResponseFormat, ledger: _Ledger) -> Response:
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

    async def _stream(self, request: Request, gen: Generation, fmt: ResponseFormat, ledger: _Ledger) -> Response:
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

        return _ClosingStreamingResponse(
            events,
            closers=[events.aclose, deltas.aclose, abandon],
            headers={"x-request-id": gen.request_id, "Cache-Control": "no-cache"},
        )

    async def _events(
        self, gen: Generation, fmt: ResponseFormat, first: Delta, deltas: AsyncIterator[Delta], ledger: _Ledger
    ) -> AsyncGenerator[str, None]:
        """The SSE body: opening chunks, one chunk per visible delta, finish, usage, [DONE]."""
        try:
            for chunk in fmt.opening_chunks():
                yield _sse(chunk)
            if fmt.echo is not None:
                echoed = fmt.text_chunk(fmt.echo, gen.echoed())
                if echoed is not None:
                    yield _sse(echoed)
            delta = first
            while True:
                if delta.text or delta.scored is not None:
                    piece = fmt.text_chunk(delta.text, () if delta.scored is None else (delta.scored,))
                    if piece is not None:  # (None: held back, e.g. what may be a tool call)
                        yield _sse(piece)
                if delta.finish_reason is not None:
                    for closing in fmt.closing_chunks():
                        yield _sse(closing)
                    yield _sse(fmt.finish_chunk(delta.finish_reason, self._extension(gen)))
                    break
                delta = await anext(deltas)
            if fmt.include_usage:
                yield _sse(fmt.usage_chunk(self._usage(gen)))
        except (asyncio.CancelledError, GeneratorExit):
            ledger.failed("cancelled")
            raise
        except Exception as exc:
            # Headers are gone: report in-band as OpenAI does, then end the stream cleanly.
            error = self._fail(exc, ledger)
            yield _sse(error.body())
            yield _sse("[DONE]")
            return
        yield _sse("[DONE]")
        ledger.completed()


def create_app(
    backend: Backend,
    metrics: RouterMetrics | None = None,
    *,
    report_request_info: bool = True,
    limits: RouterLimits = RouterLimits(),
    admission: AdmissionQueue | None = None,
    keys: KeyFile | KeyStore | None = None,
    sampling_defaults: Mapping[str, float | int] | None = None,
) -> FastAPI:
    """The router's ASGI app over `backend`; `metrics` is shared with the backend for its gauges.

    `report_request_info` adds the backend's per-request `RequestInfo` (disaggregated, KV bytes
    and transfer time) to responses as a `pdserve` field; OpenAI clients ignore unknown fields.
    `admission` queues requests for capacity (None: a backend without capacity is a 429 at
    once); `keys` requires API keys on /v1 (None: no authentication, one anonymous tenant).
    `sampling_defaults`: the model's recommended temperature/top_p/top_k for requests that
    leave them unset (GenerationDefaults.sampling_defaults; None: OpenAI's).
    The queue must report to `metrics` (`AdmissionQueue(config, observer=metrics)`).
    """
    metrics = metrics if metrics is not None else RouterMetrics()
    router = _Router(backend, metrics, report_request_info, limits, admission, keys, sampling_defaults)
    if admission is not None:
        metrics.watch_admission(admission.waiting, PRIORITIES)
    tenant_of = Depends(router.authenticate)
    app = FastAPI(title="pdserve router", version=__version__, docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes, metrics=metrics)
    if keys is not None:  # outermost: the key before the body's size or its JSON
        app.add_middleware(KeysFirst, authenticate=router.authenticate)
    app.state.backend = backend
    app.state.metrics = metrics
    if backend.health is not None:  # a backend may report its members
        metrics.watch_backend(backend.health)
    app.state.router = router

    _add_error_handlers(app, metrics, limits)
    _add_openai_routes(app, router, backend, tenant_of)
    _add_operations_routes(app, backend, metrics, admission)
    return app


def _add_error_handlers(app: FastAPI, metrics: RouterMetrics, limits: RouterLimits) -> None:
    """OpenAI's error bodies for every way a request fails, counted by status."""

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        # OpenAI answers 400, not FastAPI's 422, for a body it cannot accept.
        metrics.observe_rejected(400)
        error = from_validation_errors(list(exc.errors()))
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        metrics.observe_rejected(exc.status_code)
        if exc.status_code == 413:
            return too_large(limits.max_body_bytes)
        message = f"{exc.detail}: {request.method} {request.url.path}"
        return JSONResponse(error_body(message), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.error(kv(event="unhandled_error", error=repr(exc)), exc_info=exc)
        return JSONResponse(error_body("internal error", "internal_error"), status_code=500)


def _add_openai_routes(app: FastAPI, router: _Router, backend: Backend, tenant_of: Any) -> None:
    """/v1 and the tokenizer endpoints, each behind the API key."""
    started = int(time.time())

    # The key is checked (a dependency) before the body is validated: an unauthenticated client
    # learns nothing from field errors.
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request, tenant: Tenant = tenant_of) -> Response:
        return await router.serve(request, body, tenant)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request, tenant: Tenant = tenant_of) -> Response:
        return await router.serve(request, body, tenant)

    @app.post("/tokenize", dependencies=[tenant_of])
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        return await router.tokenize(body)

    @app.post("/detokenize", dependencies=[tenant_of])
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        return await router.detokenize(body)

    @app.get("/v1/models", dependencies=[tenant_of])
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": backend.model_name,
                    "object": "model",
                    "created": started,
                    "owned_by": "pdserve",
                    "max_model_len": backend.max_model_len,
                }
            ],
        }


def _add_operations_routes(
    app: FastAPI, backend: Backend, metrics: RouterMetrics, admission: AdmissionQueue | None
) -> None:
    """/health and /metrics: no key (the pod's probes and Prometheus read them)."""

    @app.get("/health")
    async def health() -> dict[str, object]:
        body: dict[str, object] = {"status": "ok", "model": backend.model_name}
        if backend.health is not None:  # a backend may report its members
            body.update(backend.health())
        if admission is not None:
            body["admission"] = admission.snapshot()
        return body

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
