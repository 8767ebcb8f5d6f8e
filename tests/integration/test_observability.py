"""Observability against a running deployment: one trace per request across the three
processes, and the dashboard's and the alerts' series exist.

Tracing: `pdserve local --trace-file` (JSON lines from every process) serves one request; its
spans must form exactly one trace with one root (the router's request span, a child of the
client's `traceparent`), the prefill's and the decode's spans parented on the router's attempt
over gRPC, per-chunk compute and push spans, one span for the decode steps, and children inside
their parents' time. A decode killed mid-stream: the resumed request's second attempt, the
resume and the new decode's spans are in the same trace.

`pdserve local` (tiny model) serves a request; its router's `/metrics` is scraped, and so is the
operator's `/metrics` after it reconciled a service (the operator's own registry and HTTP server,
over the in-memory Kubernetes of the unit tests). Every metric name, matcher label and grouping
label that the Grafana dashboard and the PrometheusRule use must appear there, or be a label
Prometheus adds when it scrapes (`namespace`, `pod`, ... and `pdis`, which the chart's
ServiceMonitor relabels from the router Service). Every `le` an SLO rule names must be a bucket
bound the histogram really has.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import promcheck
from chart_tools import CHART, by_kind, render
from support.deployments import local_deployment
from support.local_run import LocalRun, stop_process

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow

# Labels Prometheus (prometheus-operator) puts on every scraped series; `pdis` comes from the
# relabeling of the routers' ServiceMonitor and the workers' PodMonitor
# (tests/unit/test_observability_chart.py checks both are there).
TARGET_LABELS = {"namespace", "service", "pod", "container", "endpoint", "job", "instance"}
ROUTER_TARGET_LABELS = TARGET_LABELS | {"pdis"}
WITH_PDIS = ("pdserve_router_", "pdserve_prefill_", "pdserve_decode_", "pdserve_kv_")


def declared_labels(registry: Any) -> dict[str, tuple[str, ...]]:
    """family name -> the label names its metric object declares (for families with no sample yet)."""
    return {m._name: tuple(m._labelnames) for m in registry._collector_to_names if hasattr(m, "_labelnames")}


SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}


def scraped(text: str, declared: dict[str, tuple[str, ...]]) -> dict[str, dict[str, set[str]]]:
    """sample name -> label -> values seen. A labelled family that has no sample yet (a counter
    of failures when nothing failed) is in the exposition by its HELP/TYPE lines only; its
    series are named from its type and its labels from what its metric object declares."""
    out: dict[str, dict[str, set[str]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = out.setdefault(sample.name, {})
            for k, v in sample.labels.items():
                labels.setdefault(k, set()).add(v)
        if not family.samples:
            names = declared.get(family.name)
            assert names is not None, f"{family.name} is exposed without samples and declares no labels"
            for suffix in SUFFIXES[family.type]:
                out[family.name + suffix] = {n: set() for n in names} | ({"le": set()} if suffix == "_bucket" else {})
    return out


LAYERS_PER_CHUNK = 1


@pytest.fixture(scope="module")
def local(tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("obs-local")
    run = local_deployment(
        logs,
        tiny_model_dir,
        slots=2,
        max_len=256,
        layers_per_chunk=LAYERS_PER_CHUNK,
        threads=1,
        on_exit="ignore",
        trace_file=logs / "spans.jsonl",
        prefix_cache_tokens=256,  # the dashboard's prefix cache panels read its metrics
        prefix_disk_dir=logs / "prefix-disk",  # and its disk tier panels
    )
    run.trace_file = logs / "spans.jsonl"  # type: ignore[attr-defined]
    yield run
    run.stop_cleanly()


def model_id(local: LocalRun) -> str:
    return httpx.get(f"{local.url}/v1/models", timeout=30).json()["data"][0]["id"]


def spans_of(local: LocalRun, trace_id: str, until: Any, timeout_s: float = 20.0) -> list[dict[str, Any]]:
    """The spans of `trace_id` in the trace file, once `until(spans)` holds (exporters batch)."""
    deadline = time.monotonic() + timeout_s
    while True:
        spans = [json.loads(line) for line in local.trace_file.read_text().splitlines() if line]  # type: ignore[attr-defined]
        mine = [s for s in spans if s["trace_id"] == trace_id]
        if until(mine) or time.monotonic() > deadline:
            return mine
        time.sleep(0.2)


def by_name(spans: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [s for s in spans if s["name"] == name]


def within(child: dict[str, Any], parent: dict[str, Any], slack_ns: int = 5_000_000) -> bool:
    """The child's time inside the parent's (one machine, one clock; slack for clock reads)."""
    return child["start_ns"] >= parent["start_ns"] - slack_ns and child["end_ns"] <= parent["end_ns"] + slack_ns


@pytest.fixture(scope="module")
def router_series(local) -> dict[str, dict[str, set[str]]]:
    model = model_id(local)
    reply = httpx.post(
        f"{local.url}/v1/completions",
        json={"model": model, "prompt": "hello there", "max_tokens": 4, "temperature": 0},
        timeout=120,
    )
    assert reply.status_code == 200, reply.text
    bad = httpx.post(f"{local.url}/v1/completions", json={"model": model, "prompt": "x", "max_tokens": -1}, timeout=30)
    assert bad.status_code == 400
    from pdserve_worker.api.metrics import RouterMetrics

    return scraped(httpx.get(f"{local.url}/metrics", timeout=30).text, declared_labels(RouterMetrics().registry))


@pytest.fixture(scope="module")
def worker_series(local, router_series) -> dict[str, dict[str, set[str]]]:
    """The prefill's and the decodes' /metrics (after the router fixture's request)."""
    from pdserve_worker.serving.worker_metrics import WorkerMetrics

    out: dict[str, dict[str, set[str]]] = {}
    for name in ("prefill-0", "decode-0", "decode-1"):
        role = name.split("-")[0]
        text = httpx.get(f"http://{local.child(name)['http']}/metrics", timeout=30).text
        for sample, labels in scraped(text, declared_labels(WorkerMetrics(role).registry)).items():
            merged = out.setdefault(sample, {})
            for k, v in labels.items():
                merged.setdefault(k, set()).update(v)
    return out


@pytest.fixture(scope="module")
def operator_series() -> dict[str, dict[str, set[str]]]:
    from netutil import free_port
    from pdserve_operator.broker.view import NullBrokerView
    from pdserve_operator.metrics import OperatorMetrics
    from pdserve_operator.reconcile.reconciler import Reconciler
    from support.kube_fake import DEFAULTS, fake_kube, service

    kube = fake_kube()
    kube.inner.create(service("svc", "team", {}))
    metrics = OperatorMetrics()
    asyncio.run(Reconciler(kube, NullBrokerView(), DEFAULTS, metrics=metrics).request("team", "svc", "test"))
    port = free_port()
    server, thread = metrics.serve("127.0.0.1", port)
    try:
        return scraped(
            httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text, declared_labels(metrics.registry)
        )
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def dashboard_exprs() -> list[str]:
    board = json.loads((CHART / "dashboards" / "pdserve.json").read_text())
    variables = [v["name"] for v in board["templating"]["list"]]
    panels = [p for row in board["panels"] for p in [row, *row.get("panels", [])]]
    exprs = [promcheck.grafana_expr(t["expr"], variables) for p in panels for t in p.get("targets", [])]
    for v in board["templating"]["list"]:  # label_values(metric{...}, label)
        if v["type"] == "query":
            inner, label = v["query"]["query"].removeprefix("label_values(").removesuffix(")").rsplit(",", 1)
            exprs.append(f"max by ({label.strip()}) ({promcheck.grafana_expr(inner, variables)})")
    return exprs


def rule_exprs() -> list[str]:
    [rule] = by_kind(render("--set", "prometheusRule.enabled=true"), "PrometheusRule")
    return [r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]]


def missing(exprs: list[str], series: dict[str, dict[str, set[str]]]) -> list[str]:
    problems = []
    for expr in exprs:
        use = promcheck.uses(expr)
        labels_of_expr: set[str] = set()
        for sel in use.selectors:
            if sel.metric not in series:
                problems.append(f"{sel.metric}: no such series (in {expr!r})")
                continue
            have = set(series[sel.metric])
            extra = ROUTER_TARGET_LABELS if sel.metric.startswith(WITH_PDIS) else TARGET_LABELS
            labels_of_expr |= have | extra
            for label, matchers in sel.matchers.items():
                if label not in have | extra:
                    problems.append(f"{sel.metric}: no label {label!r} (has {sorted(have)})")
                for op, value in matchers:
                    seen = series[sel.metric].get(label)
                    if seen and op == "Equal" and value not in seen:
                        problems.append(
                            f"{sel.metric}{{{label}={value!r}}}: no such value "
                            f"(seen {sorted(series[sel.metric][label])})"
                        )
        for label in use.grouping - labels_of_expr:
            problems.append(f"grouping label {label!r} is on none of the series of {expr!r}")
    return problems


def test_every_series_and_label_the_dashboard_and_rules_use_is_exposed(
    router_series, worker_series, operator_series
) -> None:
    series = {**router_series, **worker_series, **operator_series}
    exprs = dashboard_exprs() + rule_exprs()
    assert len(exprs) > 25
    assert missing(exprs, series) == []
    # The check can fail: a misspelt metric, label or bucket bound is reported.
    assert missing(["rate(pdserve_router_tokens_total[5m])"], series)
    assert missing(["sum by (decode) (pdserve_router_prompt_tokens_total)"], series)
    assert missing(['pdserve_router_time_to_first_token_seconds_bucket{le="2.4"}'], series)
    assert missing(['pdserve_operator_replicas_ready{rol="decode"}'], series)
    used = {s.metric for e in exprs for s in promcheck.uses(e).selectors}
    assert {"pdserve_prefill_queue_length", "pdserve_decode_running_requests"} <= used  # workers' too
    # #16's KV blocks and prefix cache: KV tokens (routers' and decodes'), prefix hit ratio, routing.
    assert {
        "pdserve_router_decode_kv_tokens_used",
        "pdserve_router_decode_kv_tokens_total",
        "pdserve_decode_kv_tokens_used",
        "pdserve_decode_kv_tokens_total",
        "pdserve_prefill_prefix_hit_tokens_total",
        "pdserve_prefill_prefix_query_tokens_total",
        "pdserve_prefill_prefix_cached_tokens",
        "pdserve_router_prefix_routed_total",
    } <= used
    assert {"pdserve_router_decode_kv_tokens_used"} <= {
        s.metric for e in rule_exprs() for s in promcheck.uses(e).selectors
    }


def test_router_reports_members_and_in_flight_by_role(router_series) -> None:
    assert router_series["pdserve_router_members"]["role"] == {"prefill", "decode"}
    assert router_series["pdserve_router_requests_in_flight"]["role"] == {"prefill", "decode"}
    assert router_series["pdserve_router_requests_completed_total"]["mode"] == {"disaggregated"}


def test_operator_reports_replicas_by_role_and_reconciles(operator_series) -> None:
    assert operator_series["pdserve_operator_replicas_desired"]["role"] == {"prefill", "decode", "router"}
    assert operator_series["pdserve_operator_replicas_ready"]["pdis"] == {"svc"}
    assert operator_series["pdserve_operator_reconciles_total"]["result"] == {"ok", "invalid", "error"}


def test_pdserve_top_shows_the_running_deployment(local, router_series) -> None:
    import subprocess

    from support.local_run import cli, cli_env

    out = subprocess.run(
        cli("top", "--url", local.url, "--interval", "0.5", "--once"),
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "workers reachable   prefill 1  decode 2" in out.stdout
    assert out.stdout.count("decode-") >= 2  # the KV slot rows of both decodes
    bad = subprocess.run(
        cli("top", "--url", "http://127.0.0.1:1", "--once"), capture_output=True, text=True, env=cli_env(), timeout=60
    )
    assert bad.returncode == 1 and "cannot read metrics" in bad.stderr


# ---- tracing -------------------------------------------------------------------------------------

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


def test_one_request_is_one_trace_across_router_prefill_and_decode(local) -> None:
    prompt = "tracing one request through three processes"
    reply = httpx.post(
        f"{local.url}/v1/completions",
        timeout=120,
        headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"},
        json={"model": model_id(local), "prompt": prompt, "max_tokens": 8, "temperature": 0},
    )
    assert reply.status_code == 200, reply.text
    spans = spans_of(
        local, CLIENT_TRACE, lambda s: {"router.request", "prefill", "decode.steps"} <= {x["name"] for x in s}
    )
    ids = {s["span_id"]: s for s in spans}
    [root] = by_name(spans, "router.request")
    assert root["parent_span_id"] == CLIENT_SPAN  # the client's traceparent was honoured
    assert [s for s in spans if s["parent_span_id"] not in ids] == [root], "exactly one root, under the client's span"
    assert {s["service"] for s in spans} == {"pdserve-router", "pdserve-prefill", "pdserve-decode"}
    [admission] = by_name(spans, "router.admission")
    [queue] = by_name(spans, "router.queue")  # the admission queue's wait for a KV reservation
    [attempt] = by_name(spans, "router.attempt")
    [reserve] = by_name(spans, "router.reserve")
    [prefill] = by_name(spans, "prefill")
    [decode] = by_name(spans, "decode.generate")
    [wait] = by_name(spans, "decode.notify_wait")
    [steps] = by_name(spans, "decode.steps")
    [finish] = by_name(spans, "kv.push.finish")
    parent = {
        s["name"]: ids[s["parent_span_id"]]["name"]
        for s in spans
        if s is not root and s["name"] not in ("prefill.compute", "kv.push")
    }
    assert parent == {
        "router.admission": "router.request",
        "router.queue": "router.request",
        "router.attempt": "router.request",
        "router.reserve": "router.attempt",
        "prefill": "router.attempt",
        "decode.generate": "router.attempt",
        "decode.notify_wait": "decode.generate",
        "decode.steps": "decode.generate",
        "kv.push.finish": "prefill",
    }
    layers = 4  # the tiny model (tests/support/tiny_model.py)
    computes, pushes = by_name(spans, "prefill.compute"), by_name(spans, "kv.push")
    assert len(computes) == len(pushes) == layers // LAYERS_PER_CHUNK
    assert {ids[s["parent_span_id"]]["name"] for s in computes + pushes} == {"prefill"}
    assert sorted(s["attributes"]["pdserve.layers.first"] for s in pushes) == list(range(0, layers, LAYERS_PER_CHUNK))
    for child in [admission, queue, attempt, reserve, prefill, decode, wait, steps, finish, *computes, *pushes]:
        assert within(child, ids[child["parent_span_id"]]), child["name"]
    # The attributes the issue asks for.
    assert root["attributes"]["gen_ai.request.model"] == model_id(local)
    assert root["attributes"]["gen_ai.usage.input_tokens"] == prefill["attributes"]["gen_ai.usage.input_tokens"] > 0
    assert root["attributes"]["gen_ai.usage.output_tokens"] == 8 == steps["attributes"]["gen_ai.usage.output_tokens"]
    assert steps["attributes"]["pdserve.decode.steps"] == 7 and steps["attributes"]["pdserve.decode.mean_step_ms"] > 0
    assert (
        root["attributes"]["pdserve.kv.bytes"]
        == prefill["attributes"]["pdserve.kv.bytes"]
        == finish["attributes"]["pdserve.kv.bytes"]
        > 0
    )
    assert decode["attributes"]["pdserve.slot"] == attempt["attributes"]["pdserve.slot"]
    assert (
        decode["attributes"]["pdserve.decode.member"]
        == attempt["attributes"]["pdserve.decode.member"]
        == root["attributes"]["pdserve.decode.member"]
    )
    assert root["status"] == "UNSET" and root["attributes"]["pdserve.outcome"] == "ok"


def test_a_request_without_traceparent_starts_its_own_trace(local) -> None:
    before = {json.loads(line)["trace_id"] for line in local.trace_file.read_text().splitlines() if line}
    reply = httpx.post(
        f"{local.url}/v1/completions",
        timeout=120,
        json={"model": model_id(local), "prompt": "a new trace", "max_tokens": 2, "temperature": 0},
    )
    assert reply.status_code == 200
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        spans = [json.loads(line) for line in local.trace_file.read_text().splitlines() if line]
        new = {s["trace_id"] for s in spans} - before
        roots = [s for s in spans if s["trace_id"] in new and s["name"] == "router.request"]
        if roots and any(s["trace_id"] in new and s["name"] == "decode.steps" for s in spans):
            break
        time.sleep(0.2)
    assert len(new) == 1 and roots[0]["parent_span_id"] is None


def decode_busy(local: LocalRun, name: str) -> bool:
    import grpc

    from pdserve.v1 import worker_pb2, worker_pb2_grpc

    with grpc.insecure_channel(local.child(name)["grpc"]) as channel:
        status = worker_pb2_grpc.DecodeStub(channel).Status(
            worker_pb2.StatusRequest(), metadata=(("authorization", f"Bearer {local.token}"),), timeout=5
        )
    return status.active_requests > 0


def kill_the_serving_decode(local: LocalRun, trace: str) -> str | None:
    """Stream a long request under `trace`; after its second chunk, kill the decode serving it.

    Both decodes are frozen at once (confirmed stopped, not only signalled), then woken one by
    one: the one holding the request is killed as soon as found. None: the request had already
    finished when they froze (a loaded machine reads the second chunk late; the tiny model
    generates 240 tokens in about a second), so there was nothing to resume.
    """
    killed: list[str] = []
    with httpx.stream(
        "POST",
        f"{local.url}/v1/completions",
        timeout=120,
        headers={"traceparent": f"00-{trace}-b7ad6b7169203331-01"},
        json={
            "model": model_id(local),
            "prompt": "resume me",
            "max_tokens": 240,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        },
    ) as reply:
        assert reply.status_code == 200
        chunks = 0
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunks += 1
            if chunks == 2:
                decodes = ["decode-0", "decode-1"]
                for name in decodes:
                    stop_process(local.child(name)["pid"])
                for name in decodes:
                    os.kill(local.child(name)["pid"], signal.SIGCONT)
                    if not killed and decode_busy(local, name):
                        os.kill(local.child(name)["pid"], signal.SIGKILL)
                        killed.append(name)
    return killed[0] if killed else None


def test_a_resumed_request_shows_the_resume_in_the_same_trace(local) -> None:
    """Runs last: it kills a decode (the deployment carries on without it, --on-exit ignore)."""
    killed: list[str] = []
    for attempt in range(3):  # a fresh trace each time the request outran the freeze
        trace = f"0af7651916cd43dd8448eb211c8031{attempt:02x}"
        if victim := kill_the_serving_decode(local, trace):
            killed.append(victim)
            break
    assert killed, "in 3 tries the request finished before its decode could be frozen"
    spans = spans_of(
        local,
        trace,
        lambda s: (
            len(by_name(s, "router.attempt")) == 2 and by_name(s, "router.request") and by_name(s, "decode.steps")
        ),
    )
    [root] = by_name(spans, "router.request")
    attempts = sorted(by_name(spans, "router.attempt"), key=lambda s: s["attributes"]["pdserve.retry"])
    assert [a["attributes"]["pdserve.retry"] for a in attempts] == [0, 1]
    assert attempts[0]["status"] == "ERROR" and attempts[1]["attributes"]["pdserve.finished"] is True
    assert attempts[1]["attributes"]["pdserve.resumed_tokens"] >= 2
    [resume] = by_name(spans, "router.resume")
    assert resume["parent_span_id"] == root["span_id"] and resume["attributes"]["pdserve.failed.member"] == killed[0]
    assert attempts[0]["end_ns"] <= resume["start_ns"] + 5_000_000 <= attempts[1]["start_ns"] + 10_000_000
    # The survivor's spans hang under the second attempt, in the same trace.
    [decode] = [d for d in by_name(spans, "decode.generate") if d["parent_span_id"] == attempts[1]["span_id"]]
    assert decode["attributes"]["pdserve.decode.member"] != killed[0]
    assert root["attributes"]["pdserve.resumes"] == 1
