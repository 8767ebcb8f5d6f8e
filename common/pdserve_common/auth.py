"""Per-service bearer tokens on every gRPC call, and TLS when certificates are configured.

Every call carries `authorization: Bearer <token>`; a server resolves it to its service
(`TokenTable`) and answers UNAUTHENTICATED for no, a malformed or an unknown token, and
PERMISSION_DENIED for a known token of another service than the request's `service_key`. A
worker's table holds only its own service's tokens, so another service's token is unknown there.
An unknown or missing token is refused from the headers alone, before the message is read (a
peer with no token cannot hold a call open by never sending it).

Credentials by role: only the operator holds the service token; every pod gets its role's token
(`role_token`, an HMAC of it), and a server's `policy` says which roles may call each method (a
router watches membership and calls workers, never registers). Handlers learn the caller's role
from `caller_role()`. On plaintext channels clients add the header by interceptor; with TLS by
`access_token_call_credentials` composed into the channel credentials.
"""

from __future__ import annotations

import contextvars
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


ROLES = ("router", "prefill", "decode")
SERVICE_ROLE = "service"  # the service token itself: every role (the operator, and tools holding the Secret)
# A gateway's token (credentials.gateway_token): a router's endpoint picker admits it, nothing else does.
GATEWAY_ROLE = "gateway"
_ROLE_TOKEN_PREFIX = "pdr1"


def role_token(service_token: str, role: str) -> str:
    """The token of `role` pods of the service whose token is `service_token`:
    `pdr1.<role>.<hex HMAC-SHA256(service token, purpose)>`. One-way: a role token reveals
    neither the service token nor another role's."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    mac = hmac.new(service_token.encode(), f"pdserve role token v1 {role}".encode(), hashlib.sha256).hexdigest()
    return f"{_ROLE_TOKEN_PREFIX}.{role}.{mac}"


def role_of_token(token: str) -> str | None:
    """The role a role token names (None for any other token); what it names is proven only by a
    table that knows the token."""
    parts = token.split(".")
    return parts[1] if len(parts) == 3 and parts[0] == _ROLE_TOKEN_PREFIX and parts[1] in ROLES else None


def token_digest(token: str) -> str:
    """The hex digest a worker is told to accept a role token by (not a secret)."""
    return _digest(token).hex()


@dataclass(frozen=True)
class Principal:
    service: str
    role: str  # one of ROLES, or SERVICE_ROLE


class TokenTable:
    """Tokens by digest -> (service, role); thread-safe (the operator updates it live)."""

    def __init__(self, tokens: Mapping[str, str] | None = None) -> None:
        self._lock = threading.Lock()
        self._by_service: dict[str, set[bytes]] = {}
        self._by_digest: dict[bytes, Principal] = {}
        for service, token in (tokens or {}).items():
            self.set(service, token)

    def set(self, service_key: str, token: str) -> None:
        """The service's token (every role) and the role tokens derived from it."""
        if not token or any(c.isspace() for c in token):
            raise ValueError(f"token of service {service_key!r} must be non-empty without whitespace")
        entries = {_digest(token): SERVICE_ROLE} | {_digest(role_token(token, r)): r for r in ROLES}
        self._replace(service_key, entries)

    def accept(self, service_key: str, digests: Mapping[str, str]) -> None:
        """Tokens by role -> hex digest (a worker's table: it holds no token but its own); the role
        may be SERVICE_ROLE (the service token's digest)."""
        known = (*ROLES, SERVICE_ROLE, GATEWAY_ROLE)
        bad = [role for role in digests if role not in known]
        if bad:
            raise ValueError(f"accepted roles must be among {', '.join(known)}, got {bad}")
        try:
            entries = {bytes.fromhex(d): role for role, d in digests.items()}
        except ValueError:
            raise ValueError(f"accepted token digests of {service_key!r} must be hex SHA-256 digests") from None
        if any(len(d) != 32 for d in entries):
            raise ValueError(f"accepted token digests of {service_key!r} must be 32-byte SHA-256 digests")
        self._replace(service_key, entries)

    def _replace(self, service_key: str, entries: Mapping[bytes, str]) -> None:
        if not service_key:
            raise ValueError("service_key must not be empty")
        with self._lock:
            for digest in entries:
                owner = self._by_digest.get(digest)
                if owner is not None and owner.service != service_key:
                    raise ValueError(f"service {service_key!r} cannot share a token with service {owner.service!r}")
            for old in self._by_service.pop(service_key, set()):
                self._by_digest.pop(old, None)
            self._by_service[service_key] = set(entries)
            for digest, role in entries.items():
                self._by_digest[digest] = Principal(service_key, role)

    def remove(self, service_key: str) -> bool:
        with self._lock:
            digests = self._by_service.pop(service_key, None)
            if digests is None:
                return False
            for digest in digests:
                self._by_digest.pop(digest, None)
            return True

    def principal(self, token: str) -> Principal | None:
        """Who a token is: its service and role (None: unknown here)."""
        with self._lock:
            return self._by_digest.get(_digest(token))

    def service_for(self, token: str) -> str | None:
        found = self.principal(token)
        return None if found is None else found.service

    def services(self) -> list[str]:
        with self._lock:
            return sorted(self._by_service)

    def verify(self, service_key: str, token: str) -> bool:
        """Whether `token` is the service token of `service_key` (not one of its role tokens)."""
        found = self.principal(token)
        return found is not None and found.service == service_key and found.role == SERVICE_ROLE


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
    principal = tokens.principal(token)
    if principal is None:
        return Denial(grpc.StatusCode.UNAUTHENTICATED, "token is not valid for any service here")
    wanted = getattr(request, "service_key", None) if request is not None else None
    if wanted is not None and wanted != principal.service:
        return Denial(grpc.StatusCode.PERMISSION_DENIED, f"token does not grant access to service {wanted!r}")
    return None


# Who made the call a handler serves (set for the handler by ServiceAuthInterceptor).
_CALLER: contextvars.ContextVar[Principal | None] = contextvars.ContextVar("pdserve_caller", default=None)


def caller() -> Principal | None:
    """The principal of the call being served (None outside an authenticated handler)."""
    return _CALLER.get()


# A server's policy: method (/package.Service/Method) -> the roles that may call it (the service
# token may call anything). A method the policy does not name is open to every role.
Policy = Mapping[str, frozenset[str]]


class ServiceAuthInterceptor(grpc.aio.ServerInterceptor):
    """Checks every call's token before the handler runs (see the module docstring)."""

    def __init__(self, tokens: TokenTable, policy: Policy | None = None) -> None:
        self._tokens = tokens
        self._policy = policy or {}

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
        principal = self._tokens.principal(token)
        if principal is None:
            return _refused_unread(Denial(grpc.StatusCode.UNAUTHENTICATED, "token is not valid for any service here"))
        method = handler_call_details.method
        allowed = self._policy.get(method)
        if allowed is not None and principal.role != SERVICE_ROLE and principal.role not in allowed:
            return _refused_unread(
                Denial(grpc.StatusCode.PERMISSION_DENIED, f"a {principal.role}'s token may not call {method}")
            )
        return _guarded(handler, lambda request: authorize(self._tokens, metadata, request), principal)


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
    handler: grpc.RpcMethodHandler[Any, Any], check: Callable[[Any], Denial | None], principal: Principal
) -> grpc.RpcMethodHandler[Any, Any]:
    """The same handler with `check` run before its behaviour: on the request of a unary-request
    call; on None for request streams (they carry no service_key field: the token alone decides);
    the behaviour runs with `caller()` = `principal`."""
    attribute, factory = _KINDS[(bool(handler.request_streaming), bool(handler.response_streaming))]
    subject = (lambda _iterator: None) if handler.request_streaming else (lambda request: request)
    wrapped = _guard_behavior(getattr(handler, attribute), check, subject, principal)
    return factory(
        wrapped, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
    )


def _guard_behavior(
    behavior: Callable[..., Any],
    check: Callable[[Any], Denial | None],
    subject: Callable[[Any], Any],
    principal: Principal,
) -> Callable[..., Any]:
    """Wrap a grpc.aio behaviour in the same shape: an async generator stays one (a streaming
    reply), anything else becomes a coroutine (a unary reply, or a stream written with
    `context.write`)."""
    if inspect.isasyncgenfunction(behavior):

        async def guarded_stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
            denial = check(subject(request))
            if denial is not None:
                await context.abort(denial.code, denial.details)
            _CALLER.set(principal)
            async for item in behavior(request, context):
                yield item

        return guarded_stream

    async def guarded(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        denial = check(subject(request))
        if denial is not None:
            await context.abort(denial.code, denial.details)
        _CALLER.set(principal)
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
