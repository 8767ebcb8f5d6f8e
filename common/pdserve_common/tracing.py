"""OpenTelemetry tracing of one request across router, prefill and decode; nothing when off.

Off unless `PDSERVE_TRACING_ENDPOINT` (an OTLP/gRPC collector) or `PDSERVE_TRACE_FILE` (JSON
lines, one span per line, for `pdserve local --trace-file`) is set, and then only where the
optional extra is installed (`pdserve[tracing]`): otherwise every function here is a cheap no-op
and `opentelemetry` is never imported.

Context travels as W3C trace context (`traceparent`): the router honours an incoming header;
every gRPC call carries the current span's (`client_interceptors`); a gRPC handler continues the
caller's trace with `extract(context.invocation_metadata())`. Sampling is parent-based with
`PDSERVE_TRACING_SAMPLE_RATIO` at the root, so a request is traced in every process or in none.
Spans that live across `yield`s (a streaming request) are started with `start_span` and made
current only around the awaits that need them (`use`): a generator may be closed elsewhere.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from pdserve_common import pod_env as E
from pdserve_common.logs import kv

log = logging.getLogger(__name__)

ENV_ENDPOINT = E.TRACING_ENDPOINT
ENV_SAMPLE_RATIO = E.TRACING_SAMPLE_RATIO
ENV_FILE = E.TRACE_FILE
TRACEPARENT = "traceparent"


class _NoopSpan:
    """What every call returns while tracing is off: accepts everything, records nothing."""

    __slots__ = ()

    def set_attribute(self, key: str, value: Any) -> None:
        pass

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        pass

    def add_event(self, name: str, attributes: Mapping[str, Any] | None = None) -> None:
        pass

    def record_exception(self, exc: BaseException) -> None:
        pass

    def set_error(self, message: str) -> None:
        pass

    def end(self) -> None:
        pass

    def is_recording(self) -> bool:
        return False


NOOP = _NoopSpan()


class _Span:
    """A thin handle over an SDK span (so callers never import opentelemetry)."""

    __slots__ = ("otel", "ended", "_context")

    def __init__(self, otel: Any) -> None:
        self.otel = otel
        self.ended = False
        self._context: Any = None

    def context(self) -> Any:
        """The OpenTelemetry context with this span current (made once: `use` runs per token)."""
        if self._context is None:
            from opentelemetry import trace

            self._context = trace.set_span_in_context(self.otel)
        return self._context

    def set_attribute(self, key: str, value: Any) -> None:
        if value is not None:
            self.otel.set_attribute(key, value)

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        self.otel.set_attributes({k: v for k, v in attributes.items() if v is not None})

    def add_event(self, name: str, attributes: Mapping[str, Any] | None = None) -> None:
        self.otel.add_event(name, {k: v for k, v in (attributes or {}).items() if v is not None})

    def record_exception(self, exc: BaseException) -> None:
        self.otel.record_exception(exc)
        self.set_error(f"{type(exc).__name__}: {exc}")

    def set_error(self, message: str) -> None:
        from opentelemetry.trace import Status, StatusCode

        self.otel.set_status(Status(StatusCode.ERROR, message))

    def end(self) -> None:
        if not self.ended:  # idempotent: whichever path ends a request's span first wins
            self.ended = True
            self.otel.end()

    def is_recording(self) -> bool:
        return bool(self.otel.is_recording())


class _Tracing:
    def __init__(self, provider: Any, tracer: Any) -> None:
        self.provider = provider
        self.tracer = tracer


_state: _Tracing | None = None
_lock = threading.Lock()
_otel_context: Any = None  # opentelemetry.context, once tracing is on


def enabled() -> bool:
    return _state is not None


def available() -> bool:
    """Whether the tracing extra (the OpenTelemetry SDK) is installed."""
    import importlib.util

    try:
        return importlib.util.find_spec("opentelemetry.sdk.trace") is not None
    except ModuleNotFoundError:
        return False


def setup(service: str, instance: str = "", env: Mapping[str, str] | None = None, *, edge: bool = False) -> bool:
    """Turn tracing on for this process if the environment asks for it; True when it is on.

    `service` names the process's role (`pdserve-router`, `pdserve-prefill`, ...), `instance`
    the member id. An endpoint or file set without the extra installed is logged, not fatal:
    serving matters more than its traces.

    `edge` (the router): callers are untrusted, so a client's sampled `traceparent` links the
    trace but does not force it to be recorded; the ratio still decides (by trace id), else any
    client could have every request traced and exported. Workers (`edge` False) follow the
    router's decision, which reaches them only over the service's authenticated gRPC.
    """
    global _state, _otel_context
    env = os.environ if env is None else env
    endpoint, path = env.get(ENV_ENDPOINT, "").strip(), env.get(ENV_FILE, "").strip()
    if not endpoint and not path:
        return False
    raw_ratio = env.get(ENV_SAMPLE_RATIO, "1.0") or "1.0"
    try:
        ratio = float(raw_ratio)
    except ValueError:
        raise ValueError(f"{ENV_SAMPLE_RATIO} must be a number within [0, 1], got {raw_ratio!r}") from None
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"{ENV_SAMPLE_RATIO} must be within [0, 1], got {ratio}")
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        if endpoint:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    except ImportError:
        log.warning(
            kv(
                event="tracing_unavailable",
                endpoint=endpoint,
                file=path,
                detail="install the tracing extra (pip install pdserve[tracing]); serving without traces",
            )
        )
        return False
    from opentelemetry import context as otel_context

    _otel_context = otel_context
    with _lock:
        if _state is not None:
            return True
        resource = Resource.create({"service.name": service, "service.instance.id": instance or service})
        by_ratio = TraceIdRatioBased(ratio)
        sampler = ParentBased(by_ratio, remote_parent_sampled=by_ratio) if edge else ParentBased(by_ratio)
        provider = TracerProvider(resource=resource, sampler=sampler)
        if path:
            # Short delay: a file is read by a person or a test right after the request.
            provider.add_span_processor(BatchSpanProcessor(JsonLinesExporter(path), schedule_delay_millis=200))
        if endpoint:  # OTLP/gRPC; an http:// endpoint is plaintext, https:// TLS (the exporter's rule)
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        _state = _Tracing(provider, provider.get_tracer("pdserve"))
    log.info(kv(event="tracing_on", service=service, endpoint=endpoint, file=path, sample_ratio=ratio))
    return True


def shutdown() -> None:
    """Export what is buffered and turn tracing off (a process's last step; tests)."""
    global _state
    with _lock:
        state, _state = _state, None
    if state is not None:
        state.provider.shutdown()


# ---- spans -------------------------------------------------------------------------------------


def start_span(name: str, attributes: Mapping[str, Any] | None = None, parent: Any = None) -> Any:
    """A span that the caller ends (`.end()`); its parent is `parent` (a span, or a context
    from `extract`) or else the current span."""
    if _state is None:
        return NOOP
    return _Span(_state.tracer.start_span(name, context=_context_of(parent), attributes=_clean(attributes)))


def record(
    name: str, start_ns: int, end_ns: int, attributes: Mapping[str, Any] | None = None, parent: Any = None
) -> None:
    """A finished span with the given wall-clock times (time.time_ns()): for work timed on a
    thread or in a loop, where a `with` block cannot sit."""
    if _state is None:
        return
    otel = _state.tracer.start_span(
        name, context=_context_of(parent), attributes=_clean(attributes), start_time=start_ns
    )
    otel.end(end_time=max(end_ns, start_ns))


def now_ns() -> int:
    """Wall-clock nanoseconds, the clock spans use (0 when tracing is off: nobody reads it)."""
    return time.time_ns() if _state is not None else 0


class _Off:
    """The context manager `span` and `use` return while tracing is off: one shared object, so
    the per-token path costs an attribute lookup, not a generator (benchmarks/router_overhead.py)."""

    __slots__ = ()

    def __enter__(self) -> _NoopSpan:
        return NOOP

    def __exit__(self, *exc: object) -> None:
        return None


_OFF = _Off()


def span(name: str, attributes: Mapping[str, Any] | None = None, parent: Any = None) -> Any:
    """A span around a block (no `yield` of a generator inside it), current within the block;
    an exception leaving the block marks it failed."""
    if _state is None:
        return _OFF
    return _span_on(name, attributes, parent)


@contextlib.contextmanager
def _span_on(name: str, attributes: Mapping[str, Any] | None, parent: Any) -> Iterator[Any]:
    assert _state is not None
    with _state.tracer.start_as_current_span(
        name,
        context=_context_of(parent),
        attributes=_clean(attributes),
        record_exception=True,
        set_status_on_exception=True,
    ) as otel:
        yield _Span(otel)


def use(handle: Any) -> Any:
    """Make `handle` (a span from `start_span`) current within the block, without ending it."""
    if _state is None or not isinstance(handle, _Span):
        return _OFF
    return _use_on(handle)


class _use_on:  # noqa: N801 - used like the function it replaces
    """Attach on enter, detach on exit (a class, not a generator: it runs once per token)."""

    __slots__ = ("_span", "_token")

    def __init__(self, handle: _Span) -> None:
        self._span = handle
        self._token: Any = None

    def __enter__(self) -> None:
        self._token = _otel_context.attach(self._span.context())

    def __exit__(self, *exc: object) -> None:
        _otel_context.detach(self._token)


def _context_of(parent: Any) -> Any:
    if parent is None:
        return None
    if isinstance(parent, _Span):
        return parent.context()
    if isinstance(parent, _NoopSpan):
        return None
    return parent  # a Context from extract()


def _clean(attributes: Mapping[str, Any] | None) -> dict[str, Any] | None:
    return None if attributes is None else {k: v for k, v in attributes.items() if v is not None}


# ---- W3C trace context in and out ---------------------------------------------------------------


def extract(carrier: Any) -> Any:
    """The trace context in HTTP headers or gRPC metadata (a mapping, or (key, value) pairs);
    None when off or absent. A malformed `traceparent` is ignored (a new trace starts), as the
    W3C spec asks."""
    if _state is None or carrier is None:
        return None
    from opentelemetry.propagate import extract as otel_extract

    if not isinstance(carrier, Mapping):
        carrier = {str(k).lower(): v for k, v in carrier if isinstance(v, str)}
    return otel_extract(carrier)


def inject() -> dict[str, str]:
    """`traceparent` (and `tracestate`) of the current span, to send along; {} when off."""
    if _state is None:
        return {}
    from opentelemetry.propagate import inject as otel_inject

    carrier: dict[str, str] = {}
    otel_inject(carrier)
    return carrier


def client_interceptors() -> list[Any]:
    """gRPC aio client interceptors adding the current trace context to every call (one per call
    kind: grpc.aio files each interceptor under the first kind it matches)."""
    import grpc

    def details(d: Any) -> Any:
        headers = inject()
        if not headers:
            return d
        metadata = grpc.aio.Metadata(*(d.metadata or ()))
        for key, value in headers.items():
            metadata.add(key, value)
        return d._replace(metadata=metadata)

    class UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
        async def intercept_unary_unary(self, continuation: Any, call_details: Any, request: Any) -> Any:
            return await continuation(details(call_details), request)

    class UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
        async def intercept_unary_stream(self, continuation: Any, call_details: Any, request: Any) -> Any:
            return await continuation(details(call_details), request)

    class StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
        async def intercept_stream_unary(self, continuation: Any, call_details: Any, request_iterator: Any) -> Any:
            return await continuation(details(call_details), request_iterator)

    class StreamStream(grpc.aio.StreamStreamClientInterceptor):
        async def intercept_stream_stream(self, continuation: Any, call_details: Any, request_iterator: Any) -> Any:
            return await continuation(details(call_details), request_iterator)

    return [UnaryUnary(), UnaryStream(), StreamUnary(), StreamStream()]


# ---- the JSON-lines file exporter ---------------------------------------------------------------


def span_record(span: Any) -> dict[str, Any]:
    """One finished SDK span as a JSON-able dict (ids in W3C hex)."""
    ctx = span.get_span_context()
    parent = span.parent
    return {
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_span_id": f"{parent.span_id:016x}" if parent is not None else None,
        "name": span.name,
        "service": span.resource.attributes.get("service.name"),
        "instance": span.resource.attributes.get("service.instance.id"),
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "attributes": dict(span.attributes or {}),
        "events": [
            {"name": e.name, "time_ns": e.timestamp, "attributes": dict(e.attributes or {})} for e in span.events
        ],
    }


def _exporter_base() -> type:
    from opentelemetry.sdk.trace.export import SpanExporter

    return SpanExporter


class JsonLinesExporter:
    """Appends one JSON object per span to a file; several processes may share the file.

    (The class is built when first used: its base class is the SDK's, and this module must
    import without the SDK.)

    Each batch is one `write` on a descriptor opened with O_APPEND, so lines of different
    processes never interleave within a line (Linux appends each write whole on a local file).
    Written by hand because the SDK's ConsoleSpanExporter prints multi-line JSON to a stream.
    """

    def __new__(cls, path: str) -> Any:
        base = _exporter_base()

        class _Exporter(base):  # type: ignore[misc, valid-type]
            def __init__(self, path: str) -> None:
                self.path = path
                self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

            def export(self, spans: Sequence[Any]) -> Any:
                from opentelemetry.sdk.trace.export import SpanExportResult

                data = "".join(json.dumps(span_record(s), separators=(",", ":")) + "\n" for s in spans).encode()
                try:
                    os.write(self._fd, data)
                except OSError as exc:
                    log.warning(kv(event="trace_file_write_failed", path=self.path, error=str(exc)))
                    return SpanExportResult.FAILURE
                return SpanExportResult.SUCCESS

            def shutdown(self) -> None:
                with contextlib.suppress(OSError):
                    os.close(self._fd)

            def force_flush(self, timeout_millis: int = 30000) -> bool:
                return True

        return _Exporter(path)
