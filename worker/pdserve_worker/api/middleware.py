"""The router's ASGI middlewares: an API key before anything else, and the body's size.

With API keys on, a request to a keyed path without a known key is answered 401 before its
body is read or parsed; a body larger than the limit is answered 413 in OpenAI's error shape,
unread when its Content-Length says so, or the moment a chunked body passes the limit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from pdserve_worker.api.errors import ApiError
from pdserve_worker.api.keys import Tenant
from pdserve_worker.api.metrics import RouterMetrics
from pdserve_worker.api.openai_api import error_body


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
