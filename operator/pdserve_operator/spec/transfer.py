"""How KV moves from prefill to decode."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pdserve_operator.spec.base import Model


class TransferSpec(Model):
    """How KV moves from prefill to decode."""

    backend: Literal["hixl", "cpu", "auto"] = Field(
        "auto",
        description="hixl (CANN one-sided transfer, NPU only), cpu (host-memory engine), auto (hixl where available).",
    )
    queue_depth: int = Field(
        8,
        ge=1,
        le=1024,
        description="KV puts (one per layer and K/V) a prefill keeps in flight to each decode pod; past it, it waits "
        "for completions before putting more.",
    )
    connect_timeout_ms: int = Field(5000, ge=1, le=600_000, description="Timeout to connect to a decode engine.")
    transfer_timeout_ms: int = Field(
        30000,
        ge=1,
        le=3_600_000,
        description="Deadline of each KV put (and of retrying a full engine queue or the ready notification); a put "
        "that misses it aborts the push and disconnects that decode pod. Decode keeps an abandoned slot "
        "quarantined for this long plus 5 s, so no late write lands in a reused slot.",
    )
    engine_options: dict[str, str] = Field(
        default_factory=dict, description="Options passed verbatim to the transfer engine's initialize."
    )
