"""What the service reports besides its metrics: request tracing."""

from __future__ import annotations

from pydantic import Field

from pdserve_operator.spec.base import Model


class TracingSpec(Model):
    """OpenTelemetry tracing of requests across router, prefill and decode (common/pdserve_common/tracing.py)."""

    endpoint: str = Field(
        min_length=1,
        max_length=2048,
        pattern=r"^https?://[^\s]+$",
        description="OTLP/gRPC endpoint of an OpenTelemetry collector, e.g. http://otel-collector.observability:4317.",
    )
    sample_ratio: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description="Fraction of requests traced, decided at the router by trace id (a client's traceparent "
        "links the trace but cannot force it to be recorded); prefill and decode follow the router's decision.",
    )


class ObservabilitySpec(Model):
    """What the service reports besides its metrics."""

    tracing: TracingSpec | None = Field(None, description="Request tracing (off when unset).")
