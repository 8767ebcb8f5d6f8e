"""Request intake: from an HTTP request to what the backend is asked, or a 4xx before it is.

The tenant comes from the API key (api/keys.py), the priority class and the admission
deadline from the headers, the place in the admission queue from api/admission.py; the
prompt's token ids (api/prompt_tokens.py), the sampling parameters, max_tokens within the
context, the bad words and the grammar (api/grammar_compiler.py) from the parsed body
(api/openai_api.py). Every refusal is counted in the router's metrics.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from fastapi import Request
from pydantic import ValidationError

from pdserve_common.channels import WORKER_MAX_MESSAGE
from pdserve_common.logs import kv
from pdserve_worker.api.admission import AdmissionQueue, Rejected, Ticket
from pdserve_worker.api.backend import Backend, NoCapacity
from pdserve_worker.api.bad_words import BadWordsError, bad_word_ids
from pdserve_worker.api.errors import (
    ApiError,
    from_backend_error,
    from_rejection,
    from_validation_errors,
    rejected,
    retry_headers,
    unauthorized,
)
from pdserve_worker.api.grammar_compiler import BudgetSpent, FieldGrammarError, GrammarCompiler
from pdserve_worker.api.keys import ANONYMOUS, PRIORITIES, KeyFile, KeyStore, Tenant, TenantLimits, bearer_key
from pdserve_worker.api.logprobs import TokenText
from pdserve_worker.api.metrics import RouterMetrics
from pdserve_worker.api.openai_api import ChatCompletionRequest, CompletionRequest
from pdserve_worker.api.prompt_tokens import PromptTokens
from pdserve_worker.model.sampling.grammar import GrammarError
from pdserve_worker.model.sampling.params import SamplingParams

log = logging.getLogger(__name__)

# Bytes one (token id, logprob) pair takes in the prefill's reply, generously (proto: varint + double + tags).
PROMPT_LOGPROB_BYTES = 16
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat fills the context
DEBUG_HEADER = "x-pdserve-debug"  # "workers": name the prefill and decode in the response
PRIORITY_HEADER = "x-pdserve-priority"  # high | normal | low, capped by the key's maxPriority
DEADLINE_HEADER = "x-pdserve-deadline-ms"  # how long the request may wait for admission (only shortens)
DEFAULT_PRIORITY = "normal"
ANONYMOUS_TENANT = Tenant(ANONYMOUS, TenantLimits())


class RequestIntake:
    """What a request is admitted as: its tenant, its place in the queue, its prompt and parameters."""

    def __init__(
        self,
        backend: Backend,
        metrics: RouterMetrics,
        prompts: PromptTokens,
        grammars: GrammarCompiler,
        admission: AdmissionQueue | None = None,
        keys: KeyFile | KeyStore | None = None,
        sampling_defaults: Mapping[str, float | int] | None = None,
    ) -> None:
        self.backend = backend
        self.metrics = metrics
        self.prompts = prompts
        self.grammars = grammars
        self.admission = admission
        self.keys = keys
        self.sampling_defaults = dict(sampling_defaults or {})
        decode = backend.detokenize  # a backend without a tokenizer reports no logprobs
        self.token_texts = None if decode is None else TokenText(decode)

    def reject(self, status: int, message: str, param: str | None = None, code: str | None = None) -> ApiError:
        return rejected(self.metrics, status, message, param, code)

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

    def shows_workers(self, request: Request, tenant: Tenant) -> bool:
        """The debug header asks for the workers' names; a key may allow it (`debug: true` in
        keys.yaml), and without keys (no authentication at all) anyone may."""
        asked = "workers" in request.headers.get(DEBUG_HEADER, "").lower().replace(" ", "").split(",")
        return asked and (self.keys is None or tenant.limits.debug)

    def admission_headers(self, request: Request) -> tuple[str, float | None]:
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

    def ticket(
        self,
        tenant: Tenant,
        priority: str,
        prompt_tokens: int,
        max_tokens: int,
        deadline_s: float | None,
        request_id: str,
        grammar: bool,
    ) -> Ticket | None:
        """The request's place in the admission queue (None without one); a 429 when refused.
        `grammar`: it has structured outputs (the tenant's maxConcurrentGrammars applies)."""
        if self.admission is None:
            return None
        try:
            return self.admission.enter(tenant, priority, prompt_tokens, max_tokens, deadline_s, grammar)  # type: ignore[arg-type]
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

    def echo_text(self, body: CompletionRequest | ChatCompletionRequest) -> str | None:
        """The prompt as the response repeats it (`echo`): as sent, or its ids decoded."""
        if not isinstance(body, CompletionRequest) or not body.echo:
            return None
        ids = body.prompt_ids
        if ids is None:
            return body.prompt_text
        if self.token_texts is None:
            raise self.reject(400, "this backend cannot decode token ids: echo is not available", param="echo")
        return self.token_texts.decode(ids)

    async def _grammar(
        self, body: CompletionRequest | ChatCompletionRequest, tenant: Tenant, request_id: str
    ) -> str | None:
        """The grammar the output must match (its structured-output field's, or the one tool_choice
        required or named enforces), compiled off the event loop with the tools' schemas
        (api/grammar_compiler.py); a 400 naming the field it cannot serve, a 429 past the
        tenant's compile time or the compiler's queue."""
        spec = body.tool_spec if isinstance(body, ChatCompletionRequest) else None
        try:
            forced = spec.grammar(self.backend.tool_format) if spec is not None else None
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

    async def admit(
        self, body: CompletionRequest | ChatCompletionRequest, chat: bool, request_id: str, tenant: Tenant
    ) -> tuple[list[int], SamplingParams, int]:
        """The prompt's token ids, the sampling parameters and max_tokens; an ApiError (4xx) if
        the request cannot be served as asked."""
        self.prompts.check_model(body.model)
        prompt_ids = await self.prompts.of(body, request_id)
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
            self.prompts.checked_ids([int(k) for k in body.logit_bias], "logit_bias")
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
