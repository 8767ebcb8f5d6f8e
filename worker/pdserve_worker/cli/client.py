"""A small client of the router's OpenAI API that measures what a user feels.

Used by `pdserve complete` and `pdserve chat`: it streams the answer's text to a callback
and returns the request's timing (time to first token, time per output token) and, when the
router reports it, the KV the request moved between prefill and decode.

Built on httpx (a core dependency) rather than the `openai` package: the stream is OpenAI's
restricted server-sent events (only `data:` lines, one JSON object each, ending with
`[DONE]`), a few lines to read, and the worker image need not carry an SDK for that.
"""

from __future__ import annotations

import json
import ssl
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from pdserve_common.logs import kv


class ApiCallError(Exception):
    """The router answered with an error (HTTP status or an error event inside a stream)."""

    def __init__(self, status: int, message: str, retry_after: str | None = None) -> None:
        hint = f" (retry after {retry_after} s)" if retry_after else ""
        super().__init__(f"HTTP {status}: {message}{hint}")
        self.status = status
        self.message = message
        self.retry_after = retry_after


@dataclass
class AnswerStats:
    """Client-side timing of one request, in monotonic seconds from when it was sent."""

    sent: float
    first_text: float | None = None
    last_text: float | None = None
    finished: float | None = None
    text_chunks: int = 0
    completion_tokens: int | None = None  # from `usage`, when the server sent it
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    pdserve: dict[str, Any] | None = None  # the router's per-request report, if any

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_text is None else self.first_text - self.sent

    @property
    def tpot_s(self) -> float | None:
        """Mean time between tokens after the first; counts tokens from usage when known."""
        tokens = self.completion_tokens if self.completion_tokens is not None else self.text_chunks
        if self.first_text is None or self.last_text is None or tokens < 2:
            return None
        return (self.last_text - self.first_text) / (tokens - 1)

    @property
    def e2e_s(self) -> float | None:
        return None if self.finished is None else self.finished - self.sent

    def summary(self) -> str:
        """One key=value line for stderr: what the user waited for, and the KV that moved."""

        def ms(seconds: float | None) -> str:
            return "n/a" if seconds is None else f"{seconds * 1000:.1f}"

        fields: dict[str, object] = {
            "ttft_ms": ms(self.ttft_s),
            "tpot_ms": ms(self.tpot_s),
            "e2e_ms": ms(self.e2e_s),
            "prompt_tokens": "n/a" if self.prompt_tokens is None else self.prompt_tokens,
            "completion_tokens": "n/a" if self.completion_tokens is None else self.completion_tokens,
            "finish_reason": self.finish_reason or "n/a",
        }
        if self.pdserve is not None:
            fields["disaggregated"] = str(bool(self.pdserve.get("disaggregated"))).lower()
            fields["kv_transferred"] = _human_bytes(int(self.pdserve.get("kv_bytes", 0)))
            if "kv_transfer_ms" in self.pdserve:
                fields["kv_transfer_ms"] = self.pdserve["kv_transfer_ms"]
        return kv(**fields)


def _human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{int(size)}{unit}" if unit == "B" else f"{size:.2f}{unit}"
        size /= 1024
    raise AssertionError("unreachable")


@dataclass
class Answer:
    text: str
    stats: AnswerStats


@dataclass
class RouterClient:
    """Calls one router; `url` is its base (http://host:port), with or without `/v1`."""

    url: str
    timeout_s: float = 600.0
    verify: ssl.SSLContext | bool = True  # a context trusting an https router's CA (`pdserve local --tls`)
    api_key: str | None = field(default=None, repr=False)  # sent as `Authorization: Bearer` (spec.router.auth)
    _http: httpx.Client = field(init=False, repr=False)

    def __post_init__(self) -> None:
        base = self.url.rstrip("/")
        base = base.removesuffix("/v1")
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self._http = httpx.Client(
            base_url=base, timeout=httpx.Timeout(self.timeout_s, connect=10.0), verify=self.verify, headers=headers
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RouterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def served_model(self) -> str:
        """The model the router serves (the first of `/v1/models`)."""
        response = self._http.get("/v1/models")
        _raise_for_error(response)
        return str(response.json()["data"][0]["id"])

    def complete(self, body: dict[str, Any], *, chat: bool, on_text: Callable[[str], None] | None = None) -> Answer:
        """Send one completion request; streams through `on_text` when `body["stream"]` is true."""
        path = "/v1/chat/completions" if chat else "/v1/completions"
        stats = AnswerStats(sent=time.monotonic())
        if not body.get("stream"):
            response = self._http.post(path, json=body)
            _raise_for_error(response)
            stats.finished = time.monotonic()
            data = response.json()
            choice = data["choices"][0]
            text = choice["message"]["content"] if chat else choice["text"]
            _take_usage(stats, data)
            stats.finish_reason = choice.get("finish_reason")
            stats.pdserve = data.get("pdserve")
            if on_text is not None:
                on_text(text)
            return Answer(text, stats)
        parts: list[str] = []
        with self._http.stream("POST", path, json=body) as response:
            if response.status_code >= 400:
                response.read()
                _raise_for_error(response)
            for chunk in _sse_json(response.iter_lines()):
                if "error" in chunk:
                    error = chunk["error"] or {}
                    raise ApiCallError(response.status_code, str(error.get("message", error)))
                _take_usage(stats, chunk)
                if "pdserve" in chunk:
                    stats.pdserve = chunk["pdserve"]
                for choice in chunk.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    if piece:
                        now = time.monotonic()
                        stats.first_text = stats.first_text or now
                        stats.last_text = now
                        stats.text_chunks += 1
                        parts.append(piece)
                        if on_text is not None:
                            on_text(piece)
                    if choice.get("finish_reason"):
                        stats.finish_reason = choice["finish_reason"]
        stats.finished = time.monotonic()
        return Answer("".join(parts), stats)


def _sse_json(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    """The JSON objects of an OpenAI event stream, up to `[DONE]`."""
    for line in lines:
        if not line.startswith("data:"):
            continue  # blank separators, comments (":"), other SSE fields: not used by OpenAI
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def _take_usage(stats: AnswerStats, body: dict[str, Any]) -> None:
    usage = body.get("usage")
    if usage:
        stats.prompt_tokens = usage.get("prompt_tokens")
        stats.completion_tokens = usage.get("completion_tokens")


def _raise_for_error(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    try:
        message = str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        message = response.text[:500] or response.reason_phrase
    raise ApiCallError(response.status_code, message, response.headers.get("retry-after"))
