"""Per-service bearer tokens on every gRPC call, and TLS when certificates are configured.

Every call carries `authorization: Bearer <token>`. A server resolves the token to the one
service it belongs to (`TokenTable`); the interceptor then answers:

- no header, a malformed one, or a token it does not know: UNAUTHENTICATED;
- a known token whose service is not the `service_key` the request names: PERMISSION_DENIED.

So a worker of one service can neither see nor join another's. Requests without a
`service_key` field (the worker services) are authorised by the token alone: a worker's
table holds only its own service's token, so a token of another service is unknown to it
(UNAUTHENTICATED; it cannot tell another service's token from garbage).

A call whose headers carry no token, or one the table does not know, is refused from the
headers alone, before its request message is read: otherwise a peer with no token could keep
a call (and its connection) open by never sending the message.

Servers are grpc.aio servers. On a plaintext channel gRPC refuses to send call credentials,
so clients add the header with an interceptor there, and with `access_token_call_credentials`
(the same header, gRPC's own helper) composed into the TLS credentials otherwise.
"""

from __future__ import annotations

import hashlib
import hmac
import inspect
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

AUTH_HEADER = "authorization"
SCHEME = "Bearer"


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    return ((AUTH_HEADER, f"{SCHEME} {token}"),)


def bearer_call_credentials(token: str) -> grpc.CallCredentials:
    """Call credentials sending `authorization: Bearer <token>` (TLS channels only: gRPC drops
    call credentials on plaintext channels, where `bearer_interceptors` does the job)."""
    return grpc.access_token_call_credentials(token)


def _digest(token: str) -> bytes:
    # Keyed by digest so that the table never compares raw secrets with `==`.
    return hashlib.sha256(token.encode()).digest()


class TokenTable:
    """service_key -> token, resolvable by token; thread-safe (the operator updates it live)."""

    def __init__(self, tokens: Mapping[str, str] | None = None) -> None:
        self._lock = threading.Lock()
        self._by_service: dict[str, bytes] = {}
        self._by_digest: dict[bytes, str] = {}
        for service, token in (tokens or {}).items():
            self.set(service, token)

    def set(self, service_key: str, token: str) -> None:
        if not service_key:
            raise ValueError("service_key must not be empty")
        if not token or any(c.isspace() for c in token):
            raise ValueError(f"token of service {service_key!r} must be non-empty without whitespace")
        digest = _digest(token)
        with self._lock:
            owner = self._by_digest.get(digest)
            if owner is not None and owner != service_key:
                raise ValueError(f"service {service_key!r} cannot share a token with service {owner!r}")
            old = self._by_service.pop(service_key, None)
            if old is not None:
                self._by_digest.pop(old, None)
            self._by_service[service_key] = digest
            self._by_digest[digest] = service_key

    def remove(self, service_key: str) -> bool:
        with self._lock:
            digest = self._by_service.pop(service_key, None)
            if digest is None:
                return False
            self._by_digest.pop(digest, None)
            return True

    def service_for(self, token: str) -> str | None:
        with self._lock:
            return self._by_digest.get(_digest(token))

    def services(self) -> list[str]:
        with self._lock:
            return sorted(self._by_service)

    def verify(self, service_key: str, token: str) -> bool:
        with self._lock:
            want = self._by_service.get(service_key)
        return want is not None and hmac.compare_digest(want, _digest(token))


@dataclass(frozen=True)
class Denial:
    code: grpc.StatusCode
    details: str


def token_from_metadata(metadata: Any) -> str | Denial:
    """The bearer token of a call, or why there is none."""
    values = [v for k, v in (metadata or ()) if k == AUTH_HEADER]
    if not values:
        return Denial(grpc.StatusCode.UNAUTHENTICATED, f"missing '{AUTH_HEADER}: {SCHEME} <token>' metadata")
    if len(values) > 1:
        return Denial(grpc.StatusCode.UNAUTHENTICATED, f"{len(values)} '{AUTH_HEADER}' headers; send one")
    value = values[0] if isinstance(values[0], str) else values[0].decode(errors="replace")
    scheme, _, token = value.partition(" ")
    if scheme.lower() != SCHEME.lower() or not token.strip():
        return Denial(grpc.StatusCode.UNAUTHENTICATED, f"malformed '{AUTH_HEADER}' header: want '{SCHEME} <token>'")
    return token.strip()


def authorize(tokens: TokenTable, metadata: Any, request: Any) -> Denial | None:
    """None when the call may proceed; else the status to answer with."""
    token = token_from_metadata(metadata)
    if isinstance(token, Denial):
        return token
    principal = tokens.service_for(token)
    if principal is None:
        return Denial(grpc.StatusCode.UNAUTHENTICATED, "token is not valid for any service here")
    wanted = getattr(request, "service_key", None) if request is not None else None
    if wanted is not None and wanted != principal:
        return Denial(grpc.StatusCode.PERMISSION_DENIED, f"token does not grant access to service {wanted!r}")
    return None


class ServiceAuthInterceptor(grpc.aio.ServerInterceptor):
    """Checks every call's token before the handler runs (see the module docstring)."""

    def __init__(self, tokens: TokenTable) -> None:
        self._tokens = tokens

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        metadata = handler_call_details.invocation_metadata
        token = token_from_metadata(metadata)
        if isinstance(token, Denial):
            return _refused_unread(token)
        if self._tokens.service_for(token) is None:
            return _refused_unread(Denial(grpc.StatusCode.UNAUTHENTICATED, "token is not valid for any service here"))
        return _guarded(handler, lambda request: authorize(self._tokens, metadata, request))


def _refused_unread(denial: Denial) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler that answers `denial` at once. Request-streaming, so the server hands it the
    call before any message arrived and never reads one; the status is what the client sees,
    whatever the method's shape."""

    async def refuse(_requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await context.abort(denial.code, denial.details)

    return grpc.stream_unary_rpc_method_handler(refuse)


# (request_streaming, response_streaming) -> the handler's behaviour attribute and factory.
_KINDS: dict[tuple[bool, bool], tuple[str, Callable[..., grpc.RpcMethodHandler[Any, Any]]]] = {
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
}


def _guarded(
    handler: grpc.RpcMethodHandler[Any, Any], check: Callable[[Any], Denial | None]
) -> grpc.RpcMethodHandler[Any, Any]:
    """The same handler with `check` run before its behaviour: on the request of a unary-request
    call; on None for request streams (they carry no service_key field: the token alone decides)."""
    attribute, factory = _KINDS[(bool(handler.request_streaming), bool(handler.response_streaming))]
    subject = (lambda _iterator: None) if handler.request_streaming else (lambda request: request)
    wrapped = _guard_behavior(getattr(handler, attribute), check, subject)
    return factory(
        wrapped, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
    )


def _guard_behavior(
    behavior: Callable[..., Any], check: Callable[[Any], Denial | None], subject: Callable[[Any], Any]
) -> Callable[..., Any]:
    """Wrap a grpc.aio behaviour in the same shape: an async generator stays one (a streaming
    reply), anything else becomes a coroutine (a unary reply, or a stream written with
    `context.write`)."""
    if inspect.isasyncgenfunction(behavior):

        async def guarded_stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
            denial = check(subject(request))
            if denial is not None:
                await context.abort(denial.code, denial.details)
            async for item in behavior(request, context):
                yield item

        return guarded_stream

    async def guarded(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        denial = check(subject(request))
        if denial is not None:
            await context.abort(denial.code, denial.details)
        result = behavior(request, context)
        return await result if inspect.isawaitable(result) else result

    return guarded


class _BearerToken:
    def __init__(self, token: str) -> None:
        self._header = bearer_metadata(token)[0]

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        metadata.add(*self._header)
        replaced: grpc.aio.ClientCallDetails = details._replace(metadata=metadata)  # type: ignore[attr-defined]  # a namedtuple
        return replaced


class _UnaryUnaryBearer(_BearerToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(self._details(client_call_details), request)


class _UnaryStreamBearer(_BearerToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(self._details(client_call_details), request)


class _StreamUnaryBearer(_BearerToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, client_call_details: Any, request_iterator: Any) -> Any:
        return await continuation(self._details(client_call_details), request_iterator)


class _StreamStreamBearer(_BearerToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, client_call_details: Any, request_iterator: Any) -> Any:
        return await continuation(self._details(client_call_details), request_iterator)


def bearer_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors adding `authorization: Bearer <token>` to every call of a plaintext aio
    channel: one per call kind, because grpc.aio files each interceptor under the first
    kind it matches only."""
    return [cls(token) for cls in (_UnaryUnaryBearer, _UnaryStreamBearer, _StreamUnaryBearer, _StreamStreamBearer)]


@dataclass(frozen=True)
class TLSConfig:
    """Certificate files. Server: cert + key, and ca to require client certificates (mTLS).
    Client: ca to verify the server (system roots when unset), cert + key for mTLS, and
    server_name to check instead of the address's host (e.g. a Service DNS name)."""

    cert_file: Path | None = None
    key_file: Path | None = None
    ca_file: Path | None = None
    server_name: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, prefix: str = "PDSERVE_TLS_") -> TLSConfig | None:
        """TLS from PDSERVE_TLS_CERT/_KEY/_CA/_SERVER_NAME; None when none is set (plaintext)."""
        env = os.environ if env is None else env
        values = {name: env.get(prefix + name.upper()) or None for name in ("cert", "key", "ca", "server_name")}
        if not any(values.values()):
            return None
        return cls(
            cert_file=Path(values["cert"]) if values["cert"] else None,
            key_file=Path(values["key"]) if values["key"] else None,
            ca_file=Path(values["ca"]) if values["ca"] else None,
            server_name=values["server_name"],
        )

    def _require(self, path: Path, what: str) -> bytes:
        data = self._read(path, what)
        assert data is not None  # a path was given
        return data

    def _read(self, path: Path | None, what: str) -> bytes | None:
        if path is None:
            return None
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise ValueError(f"cannot read TLS {what} file {path}: {exc.strerror}") from exc

    def server_credentials(self) -> grpc.ServerCredentials:
        if self.cert_file is None or self.key_file is None:
            raise ValueError(
                f"a TLS server needs cert_file and key_file, got cert={self.cert_file} key={self.key_file}"
            )
        ca = self._read(self.ca_file, "ca")
        pair = (self._require(self.key_file, "key"), self._require(self.cert_file, "cert"))
        return grpc.ssl_server_credentials(
            [pair],
            root_certificates=ca,
            require_client_auth=ca is not None,
        )

    def ssl_credentials(self) -> grpc.ChannelCredentials:
        """The TLS part of a client's credentials (the token travels as call metadata)."""
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError(f"client TLS needs both cert_file and key_file or neither, got {self}")
        return grpc.ssl_channel_credentials(
            root_certificates=self._read(self.ca_file, "ca"),
            private_key=self._read(self.key_file, "key"),
            certificate_chain=self._read(self.cert_file, "cert"),
        )

    def channel_credentials(self, token: str) -> grpc.ChannelCredentials:
        return grpc.composite_channel_credentials(self.ssl_credentials(), bearer_call_credentials(token))

    def for_peer(self, server_name: str | None) -> TLSConfig:
        """The same files, verifying peers under `server_name` (None: the address's own host)."""
        return TLSConfig(self.cert_file, self.key_file, self.ca_file, server_name)
