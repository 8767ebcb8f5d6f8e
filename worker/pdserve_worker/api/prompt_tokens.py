"""A request's prompt as token ids, bounded before it costs anything; /tokenize and /detokenize.

A prompt too long to fit the context is refused by its length in characters, before it is
tokenized (api/tokenizing.max_prompt_chars); token ids a client sent are checked against the
context and the vocabulary; long prompts are tokenized off the event loop in a bounded pool
(api/tokenizing.TokenizerPool), short ones inline.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from pdserve_worker.api.backend import Backend, BackendError, InvalidPrompt
from pdserve_worker.api.errors import ApiError, from_backend_error, rejected
from pdserve_worker.api.metrics import RouterMetrics
from pdserve_worker.api.openai_api import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from pdserve_worker.api.tokenizing import TokenizerPool, max_prompt_chars

INLINE_DETOKENIZE_MAX_IDS = 512
INLINE_TOKENIZE_MAX_CHARS = 2048  # longer prompts are tokenized in a worker thread


def _chars(value: Any) -> int:
    """Characters of a value as JSON (0 for nothing)."""
    return len(json.dumps(value, ensure_ascii=False)) if value else 0


class PromptTokens:
    """Token ids of the prompts of requests to `backend`, within the model's context."""

    def __init__(self, backend: Backend, metrics: RouterMetrics, max_chars: int | None, pool: TokenizerPool) -> None:
        self.backend = backend
        self.metrics = metrics
        self.tokenizers = pool
        # None: what can fit the context (tokenizing.max_prompt_chars)
        self.max_prompt_chars = max_chars or max_prompt_chars(backend.max_model_len, backend.max_token_chars)

    def reject(self, status: int, message: str, param: str | None = None, code: str | None = None) -> ApiError:
        return rejected(self.metrics, status, message, param, code)

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        """vLLM's /tokenize: the prompt's (or conversation's) token ids as a request would get them."""
        self.check_model(body.model)
        if body.messages is not None:
            as_request: CompletionRequest | ChatCompletionRequest = ChatCompletionRequest(
                model=body.model, messages=body.messages
            )
        else:
            as_request = CompletionRequest(model=body.model, prompt=body.prompt or "")
        ids = await self.of(as_request, "tokenize")
        return {"count": len(ids), "max_model_len": self.backend.max_model_len, "tokens": ids}

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        """vLLM's /detokenize."""
        self.check_model(body.model)
        ids = self.checked_ids(body.tokens, "tokens")
        decode = self.backend.detokenize
        if decode is None:
            raise self.reject(400, "this backend cannot detokenize", param="tokens")
        # A context's worth of ids may take a while: off the event loop past a short one.
        if len(ids) <= INLINE_DETOKENIZE_MAX_IDS:
            return {"prompt": decode(ids)}
        return {"prompt": await self.tokenizers.run(lambda: decode(ids))}

    def check_model(self, model: str) -> None:
        if model != self.backend.model_name:
            raise self.reject(
                404,
                f"The model '{model}' does not exist; this server serves '{self.backend.model_name}'",
                param="model",
                code="model_not_found",
            )

    def checked_ids(self, ids: list[int], field: str) -> list[int]:
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

    async def of(self, body: CompletionRequest | ChatCompletionRequest, request_id: str) -> list[int]:
        """Token ids of the prompt; a prompt too long to fit is refused by its length in
        characters, before it is tokenized; long prompts are tokenized off the event loop.

        A thread hop costs more than tokenizing a short prompt (benchmarks/router_overhead.py),
        so short ones run inline; a long prompt must not stall the streams that share the loop.
        """
        if isinstance(body, CompletionRequest) and body.prompt_ids is not None:
            return self.checked_ids(body.prompt_ids, "prompt")
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
                (lambda: self.backend.tokenize_chat(messages, tools=tools))
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
