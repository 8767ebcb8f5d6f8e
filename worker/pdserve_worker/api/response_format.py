"""The OpenAI wire format of answers: full bodies and stream chunks, completions and chat.

Responses are built as plain dicts, one `ResponseFormat` per endpoint, so the HTTP layer
(api/responses.py) streams completions and chat alike; chat's answer is parsed for tool calls
in the model's format (api/tools.py).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve_worker import __version__
from pdserve_worker.api import tools as api_tools
from pdserve_worker.api.logprobs import Scored, TokenText, chat_block, completion_block, vllm_prompt_logprobs


def system_fingerprint(model: str, revision: str) -> str:
    """OpenAI's `system_fingerprint`: what a seeded request's determinism depends on here (this
    server's version, the served model and its revision), so a client sees when it changed."""
    digest = hashlib.sha256(f"pdserve {__version__}\n{model}\n{revision}".encode()).hexdigest()
    return f"fp_{digest[:10]}"


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens served from the prefill's prefix cache

    def as_dict(self) -> dict[str, object]:
        """OpenAI's usage object; `prompt_tokens_details.cached_tokens` as OpenAI reports prompt caching."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass(frozen=True)
class ResponseFormat:
    """How one endpoint spells its full response and its stream chunks (completions flavour)."""

    request_id: str
    model: str
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    token_text: TokenText | None = None  # set when the request asked for logprobs
    echo: str | None = None  # the prompt's text, when the request asked for it before the completion
    fingerprint: str | None = None  # `system_fingerprint`: this server's version and the model's revision
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs asked for by name: reported in vLLM's shape
    _offset: list[int] = field(default_factory=lambda: [0])  # text_offset reached (completions, streamed)

    object_full = "text_completion"
    object_chunk = "text_completion"

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        body = {"id": self.request_id, "object": obj, "created": self.created, "model": self.model}
        if self.fingerprint is not None:
            body["system_fingerprint"] = self.fingerprint
        body["choices"] = choices
        return body

    def logprobs_block(self, scored: Sequence[Scored]) -> dict[str, Any] | None:
        """The choice's `logprobs` for these tokens (None: the request asked for none)."""
        if self.token_text is None:
            return None
        block = completion_block(scored, self.token_text, self._offset[0])
        self._offset[0] += sum(len(t) for t in block["tokens"])
        return block

    def full(
        self,
        text: str,
        finish_reason: str,
        usage: Usage,
        extension: dict[str, Any] | None,
        scored: Sequence[Scored] = (),
    ) -> dict[str, Any]:
        body = self._envelope(self.object_full, [self._full_choice(text, finish_reason, self.logprobs_block(scored))])
        body["usage"] = usage.as_dict()
        if extension is not None:
            body["pdserve"] = extension
        return body

    def _full_choice(self, text: str, finish_reason: str, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def add_prompt_logprobs(self, body: dict[str, Any], prompt: Sequence[Scored], text: TokenText) -> None:
        """vLLM's `prompt_logprobs`, in its place: on the choice (completions)."""
        body["choices"][0]["prompt_logprobs"] = vllm_prompt_logprobs(prompt, text)

    def _chunk(
        self, delta: dict[str, Any], finish_reason: str | None, logprobs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        body = self._envelope(self.object_chunk, [self._chunk_choice(delta, finish_reason, logprobs)])
        if self.include_usage:
            body["usage"] = None  # OpenAI sends null on every chunk but the usage chunk
        return body

    def _chunk_choice(
        self, delta: dict[str, Any], finish_reason: str | None, logprobs: dict[str, Any] | None
    ) -> dict[str, Any]:
        return {"index": 0, "text": delta.get("content", ""), "logprobs": logprobs, "finish_reason": finish_reason}

    def opening_chunks(self) -> list[dict[str, Any]]:
        """Chunks sent before the first text (chat announces the role)."""
        return []

    def text_chunk(self, text: str, scored: Sequence[Scored] = ()) -> dict[str, Any] | None:
        """The chunk of this text (None: nothing to send now)."""
        return self._chunk({"content": text}, None, self.logprobs_block(scored) if scored else None)

    def closing_chunks(self) -> list[dict[str, Any]]:
        """Chunks sent after the last text, before the finish chunk (chat's held-back tool calls)."""
        return []

    def finish_chunk(self, finish_reason: str, extension: dict[str, Any] | None) -> dict[str, Any]:
        """The chunk that carries the finish reason (and no text, as OpenAI sends it)."""
        body = self._chunk({}, finish_reason)
        if extension is not None:
            body["pdserve"] = extension
        return body

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        body = self._envelope(self.object_chunk, [])
        body["usage"] = usage.as_dict()
        return body


@dataclass(frozen=True)
class ChatResponseFormat(ResponseFormat):
    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def logprobs_block(self, scored: Sequence[Scored]) -> dict[str, Any] | None:
        return None if self.token_text is None else chat_block(scored, self.token_text)

    def add_prompt_logprobs(self, body: dict[str, Any], prompt: Sequence[Scored], text: TokenText) -> None:
        """vLLM's `prompt_logprobs`, in its place: on the response (chat)."""
        body["prompt_logprobs"] = vllm_prompt_logprobs(prompt, text)

    # The request's tools (api/tools.py): its answer is parsed for calls in the model's format.
    tools: api_tools.ToolSpec | None = None
    tool_format: api_tools.Format = "hermes"
    _stream: list[api_tools.ToolStream] = field(default_factory=list)  # the streamed answer's splitter
    _calls: list[api_tools.ToolCall] = field(default_factory=list)  # what the stream held back

    def _full_choice(self, text: str, finish_reason: str, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.tools is not None and self.tools.active:
            content, calls = api_tools.parse_calls(text, self.tool_format, self.tools)
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": [c.as_dict() for c in calls]}
                finish_reason = "tool_calls"
        return {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}

    def _chunk_choice(
        self, delta: dict[str, Any], finish_reason: str | None, logprobs: dict[str, Any] | None
    ) -> dict[str, Any]:
        return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    def opening_chunks(self) -> list[dict[str, Any]]:
        if self.tools is not None and self.tools.active:
            self._stream.append(api_tools.ToolStream(self.tool_format, self.tools))
        return [self._chunk({"role": "assistant", "content": ""}, None)]

    def text_chunk(self, text: str, scored: Sequence[Scored] = ()) -> dict[str, Any] | None:
        if self._stream:
            text = self._stream[0].feed(text)
            if not text and not scored:
                return None
        return super().text_chunk(text, scored)

    def closing_chunks(self) -> list[dict[str, Any]]:
        """What the stream held back, at its end: text that was not a call after all, or the calls."""
        if not self._stream:
            return []
        rest, calls = self._stream[0].finish()
        self._calls.extend(calls)
        chunks = [self._chunk({"content": rest}, None)] if rest else []
        if calls:
            deltas = [{"index": i, **c.as_dict()} for i, c in enumerate(calls)]
            chunks.append(self._chunk({"tool_calls": deltas}, None))
        return chunks

    def finish_chunk(self, finish_reason: str, extension: dict[str, Any] | None) -> dict[str, Any]:
        return super().finish_chunk("tool_calls" if self._calls else finish_reason, extension)
