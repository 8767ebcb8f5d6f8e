"""How the router turns what went wrong into an OpenAI-style HTTP error.

Three sources: the request itself (validation, unknown model, too long a prompt: 4xx), the
backend (`NoCapacity` 429 with Retry-After, `BackendUnavailable` 503, `RequestTimeout` 504)
and bugs (500). The mapping is data, kept apart from the endpoints so each status code has
one place where it is decided.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from pydantic_core import ErrorDetails

from pdserve_worker.api import api_fields
from pdserve_worker.api.admission import Rejected
from pdserve_worker.api.backend import (
    BackendError,
    BackendUnavailable,
    InvalidPrompt,
    NoCapacity,
    RequestTimeout,
)
from pdserve_worker.api.metrics import RouterMetrics
from pdserve_worker.api.openai_api import error_body


@dataclass
class ApiError(Exception):
    """An error the router answers with: status, OpenAI error fields, extra headers."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


# What a client reads for a backend failure that is not `public`: nothing of the workers'
# names, addresses or gRPC details, which stay in the router's log under the request id.
_GENERIC = {
    NoCapacity: "the service has no free capacity now; retry later",
    BackendUnavailable: "the service is temporarily unavailable",
    RequestTimeout: "the request timed out",
    InvalidPrompt: "the request was refused by the service's workers",
}


def public_message(exc: BackendError, request_id: str | None) -> str:
    """The message a client reads for `exc`, with the request id that finds it in the logs."""
    if exc.public:
        text = str(exc) or type(exc).__name__
    else:
        text = next((m for kind, m in _GENERIC.items() if isinstance(exc, kind)), "internal error")
    return f"{text} (request {request_id})" if request_id else text


def rejected(
    metrics: RouterMetrics, status: int, message: str, param: str | None = None, code: str | None = None
) -> ApiError:
    """The error a request the router refuses is answered with, counted in `metrics` by status."""
    metrics.observe_rejected(status)
    return ApiError(status, message, param=param, code=code)


def retry_headers(retry_after_s: float) -> dict[str, str]:
    """Retry-After in whole seconds (RFC 9110), and retry-after-ms with the precision (the openai
    client honours both)."""
    retry = max(retry_after_s, 0.0)
    return {"Retry-After": str(max(1, math.ceil(retry))), "retry-after-ms": str(int(retry * 1000))}


def from_rejection(exc: Rejected, request_id: str | None = None) -> ApiError:
    """The 429 of a request the admission queue will not serve; `code` says why."""
    text = f"{exc} (request {request_id})" if request_id else str(exc)
    return ApiError(
        429,
        f"{text}; retry later",
        "rate_limit_error",
        None,
        exc.reason.value,
        retry_headers(min(exc.retry_after_s, MAX_RETRY_AFTER_S)),
    )


MAX_RETRY_AFTER_S = 3600.0


def unauthorized(presented: bool) -> ApiError:
    """OpenAI's 401 for a missing or unknown key; the key itself is never echoed. The
    WWW-Authenticate challenge is RFC 6750's (section 3)."""
    if presented:
        message = "Incorrect API key provided. Give the key as 'Authorization: Bearer KEY'."
        challenge = 'Bearer realm="pdserve", error="invalid_token"'
    else:
        message = "You didn't provide an API key. Give it as 'Authorization: Bearer KEY'."
        challenge = 'Bearer realm="pdserve"'
    return ApiError(401, message, "invalid_request_error", None, "invalid_api_key", {"WWW-Authenticate": challenge})


def from_backend_error(exc: BackendError, request_id: str | None = None) -> tuple[ApiError, str]:
    """The HTTP error for a backend failure, and the metrics reason label."""
    message = public_message(exc, request_id)
    if isinstance(exc, NoCapacity):
        return ApiError(
            429, message, "rate_limit_error", None, "no_capacity", retry_headers(exc.retry_after_s)
        ), "no_capacity"
    if isinstance(exc, BackendUnavailable):
        return ApiError(503, message, "service_unavailable", None, "backend_unavailable"), "unavailable"
    if isinstance(exc, RequestTimeout):
        return ApiError(504, message, "timeout", None, "timeout"), "timeout"
    if isinstance(exc, InvalidPrompt):
        return ApiError(400, message, "invalid_request_error", None, "invalid_prompt"), "invalid_prompt"
    return ApiError(500, message, "internal_error", None, "backend_error"), "backend_error"


# Location parts that pydantic adds for union branches ("str", "list[str]",
# "function-after[...]", a model's class name): noise to a client, so left out of `param`.
_TYPE_TAG = re.compile(r"(str|int|float|bool|none|list|dict)$|.*[\[\]()\-,\s].*|[A-Z].*")


def _location(loc: tuple[int | str, ...]) -> str:
    parts = [str(p) for p in loc if not (isinstance(p, str) and _TYPE_TAG.fullmatch(p))]
    if parts and parts[0] == "body":
        parts = parts[1:]
    return ".".join(parts)


def _short_repr(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def from_validation_errors(errors: list[ErrorDetails] | list[dict[str, Any]]) -> ApiError:
    """A 400 naming the first offending field, what was wrong and the value seen."""
    if not errors:
        return ApiError(400, "invalid request")
    # A union field fails once per branch ("not a string", "not a list"); a reason given by
    # one of our validators is the specific one, so it wins over the generic type errors.
    first = next((e for e in errors if e.get("type") == "value_error"), errors[0])
    kind = first.get("type", "")
    if kind == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return ApiError(400, f"request body is not valid JSON: {detail}".rstrip(": "), code="invalid_json")
    where = _location(tuple(first.get("loc", ())))
    message = str(first.get("msg", "invalid value"))
    message = message.removeprefix("Value error, ")
    if kind == api_fields.UNSUPPORTED_FIELD:  # a field of the schema this server refuses (api/api_fields.py)
        field = str((first.get("ctx") or {}).get("field", ""))
        return ApiError(400, f"{field} {message}", param=field or None, code="unsupported_parameter")
    if kind == "missing":
        text = f"missing required field '{where}'" if where else "missing request body"
    elif kind == "value_error":  # our own validators: the message already names the value
        text = f"{where}: {message}" if where else message
    elif not where:
        text = f"request body: {message} (got {_short_repr(first.get('input'))})"
    else:
        text = f"{where}: {message} (got {_short_repr(first.get('input'))})"
    return ApiError(400, text, param=where or None, code="missing_field" if kind == "missing" else "invalid_value")
