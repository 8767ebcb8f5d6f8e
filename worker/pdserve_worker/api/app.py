"""The router's OpenAI-compatible HTTP API over a `Backend`: the app and its routes.

`create_app(backend, metrics)` serves `/v1/completions` and `/v1/chat/completions` (streamed as
server-sent events in OpenAI's chunk format, or one JSON body with `usage`), `/v1/models`,
`/tokenize`, `/detokenize`, `/health` and `/metrics`. Everything topology-specific (which
decode, which slot, the KV push) is behind the backend; here is the HTTP contract:
- bad input is a 4xx with OpenAI's error envelope, decided before the backend is called
  (api/intake.py), and every input is bounded before it costs anything (`RouterLimits`);
- with API keys (`keys`) every /v1 route needs `Authorization: Bearer KEY` (api/middleware.py);
  with an admission queue (`admission`) a request waits for its KV reservation instead of a 429;
- the answer is written by api/responses.py: a client that goes away cancels the backend's
  generator, and error bodies name no worker (the log has the details under the request id).
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve_common import tracing
from pdserve_common.logs import kv
from pdserve_worker import __version__
from pdserve_worker.api import fan_out, prompt_copies
from pdserve_worker.api.admission import AdmissionQueue
from pdserve_worker.api.backend import Backend
from pdserve_worker.api.cache_scope import cache_scope
from pdserve_worker.api.errors import ApiError, from_validation_errors
from pdserve_worker.api.generation import Generation
from pdserve_worker.api.grammar_compiler import GrammarCompiler, GrammarLimits, grammar_check
from pdserve_worker.api.intake import ANONYMOUS_TENANT, RequestIntake
from pdserve_worker.api.keys import PRIORITIES, KeyFile, KeyStore, Tenant
from pdserve_worker.api.ledger import Ledger
from pdserve_worker.api.metrics import RouterMetrics
from pdserve_worker.api.middleware import BodyLimit, KeysFirst, too_large
from pdserve_worker.api.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
)
from pdserve_worker.api.prompt_tokens import PromptTokens
from pdserve_worker.api.response_format import ChatResponseFormat, ResponseFormat, system_fingerprint
from pdserve_worker.api.responses import ClosingStreamingResponse, ResponseWriter
from pdserve_worker.api.tokenizing import TOKENIZE_QUEUE, TOKENIZE_THREADS, TokenizerPool
from pdserve_worker.model.sampling.params import SamplingParams

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class RouterLimits:
    """Bounds of what one request may cost the router (README "Limits")."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger bodies are answered 413 unread
    max_prompt_chars: int | None = None  # None: what can fit the context (tokenizing.max_prompt_chars)
    tokenize_threads: int = TOKENIZE_THREADS
    tokenize_queue: int = TOKENIZE_QUEUE  # long prompts tokenizing or waiting; past it, 429
    grammar: GrammarLimits = GrammarLimits()  # structured outputs' and tools' compiling


class OpenAIFront:
    """The request path shared by both generation endpoints: intake, generation, response."""

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
        self.metrics = metrics
        self.admission = admission
        pool = TokenizerPool(limits.tokenize_threads, limits.tokenize_queue)
        self.prompts = PromptTokens(backend, metrics, limits.max_prompt_chars, pool)
        grammars = GrammarCompiler(limits.grammar, compile_one=grammar_check(backend))
        self.intake = RequestIntake(backend, metrics, self.prompts, grammars, admission, keys, sampling_defaults)
        self.writer = ResponseWriter(admission, report_request_info, self.intake.token_texts)
        self.fingerprint = system_fingerprint(backend.model_name, backend.revision)

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
        streams = [r for r in responses if isinstance(r, ClosingStreamingResponse)]
        if len(streams) < len(responses):  # one was not a stream (a 499: the client left)
            for stream in streams:
                await stream.close()
            return next(r for r in responses if not isinstance(r, ClosingStreamingResponse))
        request_id = streams[0].headers["x-request-id"]
        merged = fan_out.merged_stream(streams, body.include_usage_chunk, request_id, n)
        return ClosingStreamingResponse(
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
        priority, deadline_s = self.intake.admission_headers(request)
        with tracing.span("router.admission") as admission:  # model, tokenize, limits, sampling parameters
            prompt_ids, params, max_tokens = await self.intake.admit(body, chat, request_id, tenant)
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
        gen.show_workers = self.intake.shows_workers(request, tenant)
        fmt = self._response_format(body, request_id, params)
        await prompt_copies.wait_for_first()  # a later copy of a prompt: after the first one's prefill
        grammar = params.grammar is not None
        ticket = self.intake.ticket(tenant, priority, len(prompt_ids), max_tokens, deadline_s, request_id, grammar)
        # No await between the ticket and the ledger that releases it.
        ledger = Ledger(self.metrics, gen, "chat" if chat else "completions", self.admission, ticket)
        if body.stream:
            return await self.writer.stream(request, gen, fmt, ledger)
        return await self.writer.complete(request, gen, fmt, ledger)

    def _response_format(
        self, body: CompletionRequest | ChatCompletionRequest, request_id: str, params: SamplingParams
    ) -> ResponseFormat:
        asked = body.prompt_logprobs is not None
        token_text = None if params.logprobs is None else self.intake.token_texts
        if isinstance(body, ChatCompletionRequest):
            return ChatResponseFormat(
                request_id=request_id,
                model=self.backend.model_name,
                include_usage=body.include_usage_chunk,
                token_text=token_text,
                fingerprint=self.fingerprint,
                prompt_logprobs=asked,
                tools=body.tool_spec,
                tool_format=self.backend.tool_format,
            )
        return ResponseFormat(
            request_id=request_id,
            model=self.backend.model_name,
            include_usage=body.include_usage_chunk,
            token_text=token_text,
            echo=self.intake.echo_text(body),
            fingerprint=self.fingerprint,
            prompt_logprobs=asked,
        )


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
    front = OpenAIFront(backend, metrics, report_request_info, limits, admission, keys, sampling_defaults)
    if admission is not None:
        metrics.watch_admission(admission.waiting, PRIORITIES)
    tenant_of = Depends(front.intake.authenticate)
    app = FastAPI(title="pdserve router", version=__version__, docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes, metrics=metrics)
    if keys is not None:  # outermost: the key before the body's size or its JSON
        app.add_middleware(KeysFirst, authenticate=front.intake.authenticate)
    app.state.backend = backend
    app.state.metrics = metrics
    if backend.health is not None:  # a backend may report its members
        metrics.watch_backend(backend.health)
    app.state.front = front

    _add_error_handlers(app, metrics, limits)
    _add_openai_routes(app, front, backend, tenant_of)
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


def _add_openai_routes(app: FastAPI, front: OpenAIFront, backend: Backend, tenant_of: Any) -> None:
    """/v1 and the tokenizer endpoints, each behind the API key."""
    started = int(time.time())

    # The key is checked (a dependency) before the body is validated: an unauthenticated client
    # learns nothing from field errors.
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request, tenant: Tenant = tenant_of) -> Response:
        return await front.serve(request, body, tenant)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request, tenant: Tenant = tenant_of) -> Response:
        return await front.serve(request, body, tenant)

    @app.post("/tokenize", dependencies=[tenant_of])
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        return await front.prompts.tokenize(body)

    @app.post("/detokenize", dependencies=[tenant_of])
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        return await front.prompts.detokenize(body)

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
