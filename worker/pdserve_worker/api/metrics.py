"""The router's Prometheus metrics, in a registry of their own.

One `CollectorRegistry` per `RouterMetrics` (not the process-global default) so that several
apps in one process (tests, `pdserve local`) never collide on metric names and each
`/metrics` shows only its own router. The backend receives the same object to update the
per-decode slot gauges, since only it knows the decode membership.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from pdserve_worker.api.backend import RequestInfo
from pdserve_worker.api.keys import Priority

_PREFIX = "pdserve_router"

# Buckets sized for LLM serving: a CPU decode step is ~10-40 ms, a long prompt's TTFT seconds.
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_KV_BYTES_BUCKETS = tuple(float(1 << shift) for shift in range(10, 34, 2))  # 1 KiB .. 8 GiB
_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
_KV_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


@dataclass(frozen=True)
class RequestTiming:
    """Timestamps (monotonic seconds) of one served request, as the router saw them."""

    arrived: float
    first_token: float | None
    last_token: float | None
    finished: float
    completion_tokens: int

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrived

    @property
    def tpot_s(self) -> float | None:
        """Mean time between output tokens; needs two tokens to be defined."""
        if self.first_token is None or self.last_token is None or self.completion_tokens < 2:
            return None
        return (self.last_token - self.first_token) / (self.completion_tokens - 1)

    @property
    def e2e_s(self) -> float:
        return self.finished - self.arrived


class RouterMetrics:
    """Histograms and counters the router observes per request, gauges the backend sets."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.time_to_first_token = Histogram(
            f"{_PREFIX}_time_to_first_token_seconds",
            "From the request's arrival to its first generated token.",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.time_per_output_token = Histogram(
            f"{_PREFIX}_time_per_output_token_seconds",
            "Mean time between output tokens of one request (requests with 2+ tokens).",
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.e2e_latency = Histogram(
            f"{_PREFIX}_e2e_request_latency_seconds",
            "From the request's arrival to its last byte, for requests that completed.",
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self.kv_transfer_bytes = Histogram(
            f"{_PREFIX}_kv_transfer_bytes",
            "KV bytes pushed from prefill to decode per disaggregated request.",
            buckets=_KV_BYTES_BUCKETS,
            registry=r,
        )
        self.kv_transfer_seconds = Histogram(
            f"{_PREFIX}_kv_transfer_seconds",
            "Wall time of one request's KV push, first put to completion.",
            buckets=_KV_SECONDS_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(f"{_PREFIX}_prompt_tokens", "Prompt tokens of admitted requests.", registry=r)
        self.generation_tokens = Counter(f"{_PREFIX}_generation_tokens", "Tokens generated.", registry=r)
        self.prompt_cached_tokens = Counter(
            f"{_PREFIX}_prompt_cached_tokens",
            "Prompt tokens of answered requests whose KV came from a prefill's prefix cache "
            "(the hit rate is this over prompt_tokens).",
            registry=r,
        )
        self.prefill_roads = Counter(
            f"{_PREFIX}_prefill_roads",
            "How each attempt's prompt was computed (router/disaggregation.py): road remote (a prefill "
            "pushed it) or local (the decode computed it), and why.",
            ["road", "reason"],
            registry=r,
        )
        self.prefix_routed = Counter(
            f"{_PREFIX}_prefix_routed",
            "Prefill choices by reason: prefix (the prefill predicted to hold the longest prefix of the "
            "prompt), least_loaded (no match worth its load), copy (a later copy of an n > 1 prompt, "
            "sent where the first copy ran).",
            ["reason"],
            registry=r,
        )
        self.requests_completed = Counter(
            f"{_PREFIX}_requests_completed",
            "Requests answered in full, by how they were served (disaggregated or colocated).",
            ["mode"],
            registry=r,
        )
        self.requests_failed = Counter(
            f"{_PREFIX}_requests_failed",
            "Admitted requests that did not complete, by reason.",
            ["reason"],
            registry=r,
        )
        self.requests_rejected = Counter(
            f"{_PREFIX}_requests_rejected",
            "Requests refused before reaching the backend (bad input), by HTTP status.",
            ["status"],
            registry=r,
        )
        self.request_retries = Counter(
            f"{_PREFIX}_request_retries",
            "Times a request was resumed on another worker after its decode or prefill failed.",
            registry=r,
        )
        # Live migration off draining decodes (router/migration.py).
        self.migrations = Counter(
            f"{_PREFIX}_migrations",
            "Requests a draining decode handed over, by outcome: migrated (the KV moved to another decode), "
            "fallback (it could not: the request was resumed by re-prefilling).",
            ["outcome"],
            registry=r,
        )
        self.migration_seconds = Histogram(
            f"{_PREFIX}_migration_seconds",
            "From a decode's handover event to the target's grant filled (its Migrate answered).",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            registry=r,
        )
        self.migration_bytes = Counter(f"{_PREFIX}_migration_bytes", "KV bytes moved by migrations.", registry=r)
        self.grants_returned = Counter(
            f"{_PREFIX}_grants_returned",
            "Decode slot grants given back without a finished request, by outcome: released (free at "
            "once: no push could still write), quarantined (a push may still be running), stream (the "
            "decode's stream already held the slot), lease (the Release failed: the decode's lease reclaims it).",
            ["outcome"],
            registry=r,
        )
        self.admission_queue_length = Gauge(
            f"{_PREFIX}_admission_queue_length",
            "Requests waiting in the admission queue, by priority class.",
            ["priority"],
            registry=r,
        )
        self.admission_wait = Histogram(
            f"{_PREFIX}_admission_wait_seconds",
            "From a request's arrival in the admission queue to its KV reservation, by priority class.",
            ["priority"],
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        self.admission_rejected = Counter(
            f"{_PREFIX}_admission_rejected",
            "Requests the admission queue answered 429, by reason (queue_full, tenant_queue_full, "
            "requests_per_minute, tokens_per_minute, deadline).",
            ["reason"],
            registry=r,
        )
        self.tenant_tokens = Counter(
            f"{_PREFIX}_tenant_tokens",
            "Tokens of admitted requests per tenant (the API key's tenant; 'anonymous' without keys), by kind.",
            ["tenant", "kind"],
            registry=r,
        )
        self.decode_slots_used = Gauge(
            f"{_PREFIX}_decode_slots_used", "KV slots in use per decode instance.", ["decode"], registry=r
        )
        self.decode_slots_free = Gauge(
            f"{_PREFIX}_decode_slots_free", "KV slots free per decode instance.", ["decode"], registry=r
        )
        self.decode_kv_tokens_used = Gauge(
            f"{_PREFIX}_decode_kv_tokens_used", "KV tokens in use per decode instance.", ["decode"], registry=r
        )
        self.decode_kv_tokens_total = Gauge(
            f"{_PREFIX}_decode_kv_tokens_total", "KV tokens per decode instance.", ["decode"], registry=r
        )
        self.prefill_failures = Counter(
            f"{_PREFIX}_prefill_failures",
            "Prefill calls (prompt compute and KV push to the decode) that failed, by gRPC status code.",
            ["code"],
            registry=r,
        )
        self._backend_view = _BackendView()
        r.register(self._backend_view)

    # --- what the router calls -------------------------------------------------------------

    def observe_completed(self, timing: RequestTiming, prompt_tokens: int, info: RequestInfo | None) -> None:
        """Record one request that was answered in full."""
        self._observe_tokens(timing, prompt_tokens)
        self.e2e_latency.observe(timing.e2e_s)
        disaggregated = info is not None and info.disaggregated
        self.requests_completed.labels(mode="disaggregated" if disaggregated else "colocated").inc()
        if info is not None and info.cached_tokens:
            self.prompt_cached_tokens.inc(info.cached_tokens)
        if info is not None and info.disaggregated:
            self.kv_transfer_bytes.observe(info.kv_bytes)
            if info.kv_transfer_s is not None:
                self.kv_transfer_seconds.observe(info.kv_transfer_s)

    def observe_failed(self, reason: str, timing: RequestTiming | None = None, prompt_tokens: int = 0) -> None:
        """Record an admitted request that ended without an answer (error, timeout, disconnect)."""
        if timing is not None:
            self._observe_tokens(timing, prompt_tokens)
        self.requests_failed.labels(reason=reason).inc()

    def observe_retry(self) -> None:
        """A request lost its decode or prefill and goes on elsewhere."""
        self.request_retries.inc()

    def observe_migration(self, moved: bool, seconds: float = 0.0, kv_bytes: int = 0) -> None:
        """A handed-over request moved with its KV, or fell back to a resume."""
        self.migrations.labels(outcome="migrated" if moved else "fallback").inc()
        if moved:
            self.migration_seconds.observe(max(0.0, seconds))
            self.migration_bytes.inc(kv_bytes)

    def observe_grant_returned(self, outcome: str) -> None:
        """A grant went back to its decode without a finished request (see `grants_returned`)."""
        self.grants_returned.labels(outcome=outcome).inc()

    def observe_prefill_failure(self, code: str) -> None:
        """A prefill call (compute + KV push) failed with gRPC status `code`."""
        self.prefill_failures.labels(code=code).inc()

    def observe_rejected(self, status: int) -> None:
        self.requests_rejected.labels(status=str(status)).inc()

    def _observe_tokens(self, timing: RequestTiming, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(timing.completion_tokens)
        if timing.ttft_s is not None:
            self.time_to_first_token.observe(timing.ttft_s)
        if timing.tpot_s is not None:
            self.time_per_output_token.observe(timing.tpot_s)

    # --- what the admission queue calls (router.admission.Observer) ------------------------

    def watch_admission(self, waiting: Callable[[Priority], int], priorities: Iterable[Priority]) -> None:
        """Read the queue's length per class at each scrape (nothing to keep in sync)."""
        for priority in priorities:
            self.admission_queue_length.labels(priority=priority).set_function(partial(waiting, priority))

    def observe_admission_rejected(self, reason: str) -> None:
        self.admission_rejected.labels(reason=reason).inc()

    def observe_admission_wait(self, priority: str, seconds: float) -> None:
        self.admission_wait.labels(priority=priority).observe(seconds)

    def observe_tenant_tokens(self, tenant: str, prompt: int, completion: int) -> None:
        self.tenant_tokens.labels(tenant=tenant, kind="prompt").inc(prompt)
        self.tenant_tokens.labels(tenant=tenant, kind="completion").inc(completion)

    # --- what the backend calls ------------------------------------------------------------

    def set_decode_slots(
        self, decode: str, used: int, free: int, kv_tokens_used: int = 0, kv_tokens_total: int = 0
    ) -> None:
        """Publish one decode instance's slot and KV-token usage (called when the backend learns it)."""
        self.decode_slots_used.labels(decode=decode).set(used)
        self.decode_slots_free.labels(decode=decode).set(free)
        if kv_tokens_total:
            self.decode_kv_tokens_used.labels(decode=decode).set(kv_tokens_used)
            self.decode_kv_tokens_total.labels(decode=decode).set(kv_tokens_total)

    def observe_disaggregation(self, local: bool, reason: str) -> None:
        self.prefill_roads.labels(road="local" if local else "remote", reason=reason).inc()

    def observe_prefill_choice(self, reason: str) -> None:
        self.prefix_routed.labels(reason=reason).inc()

    def forget_decode(self, decode: str) -> None:
        """Drop a decode instance that left the membership, so its gauges do not linger."""
        for gauge in (
            self.decode_slots_used,
            self.decode_slots_free,
            self.decode_kv_tokens_used,
            self.decode_kv_tokens_total,
        ):
            try:
                gauge.remove(decode)
            except KeyError:
                pass

    def watch_backend(self, health: Callable[[], dict[str, object]]) -> None:
        """Publish the backend's `health()` at every scrape: ready members by role and requests
        in flight by role (read when scraped, so no code path has to remember to update them)."""
        self._backend_view.health = health

    def exposition(self) -> bytes:
        """The registry in Prometheus text format, for `/metrics`."""
        return generate_latest(self.registry)


class _BackendView(Collector):
    """`pdserve_router_members{role}` and `pdserve_router_requests_in_flight{role}` from the
    backend's `health()` (`members`, `in_flight`), read at scrape time."""

    def __init__(self) -> None:
        self.health: Callable[[], dict[str, object]] | None = None

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(self._families({}))

    def collect(self) -> Iterator[GaugeMetricFamily]:
        return iter(self._families(self.health() if self.health is not None else {}))

    @staticmethod
    def _families(health: dict[str, object]) -> list[GaugeMetricFamily]:
        members = GaugeMetricFamily(
            f"{_PREFIX}_members", "Workers this router could send a request to now, by role.", labels=["role"]
        )
        in_flight = GaugeMetricFamily(
            f"{_PREFIX}_requests_in_flight",
            "Requests this router has in flight now, by the role of the worker "
            "(a request counts on its prefill and its decode until it ends).",
            labels=["role"],
        )
        for family, key in ((members, "members"), (in_flight, "in_flight")):
            values = health.get(key)
            if isinstance(values, dict):
                for label, value in sorted(values.items()):
                    family.add_metric([str(label)], float(value))
        return [members, in_flight]
