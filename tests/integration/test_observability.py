"""Observability against a running deployment: the dashboard's and the alerts' series exist.

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
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from local_run import LocalRun
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "unit"))

import promcheck  # noqa: E402
from chart_tools import CHART, by_kind, render  # noqa: E402

pytestmark = pytest.mark.slow

# Labels Prometheus (prometheus-operator) puts on every scraped series; `pdis` comes from the
# routers' ServiceMonitor relabeling (tests/unit/test_observability_chart.py checks it is there).
TARGET_LABELS = {"namespace", "service", "pod", "container", "endpoint", "job", "instance"}
ROUTER_TARGET_LABELS = TARGET_LABELS | {"pdis"}


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


@pytest.fixture(scope="module")
def local(tiny_model_dir, tmp_path_factory):
    run = LocalRun.start(
        tmp_path_factory.mktemp("obs-local"),
        "--model", str(tiny_model_dir), "--dtype", "float32", "--prefill", "1", "--decode", "1",
        "--slots", "2", "--max-len", "128", "--layers-per-chunk", "1", "--port", "0",
    )
    yield run
    assert run.stop() == 0, run.stderr_path.read_text()


@pytest.fixture(scope="module")
def router_series(local) -> dict[str, dict[str, set[str]]]:
    model = httpx.get(f"{local.url}/v1/models", timeout=30).json()["data"][0]["id"]
    reply = httpx.post(f"{local.url}/v1/completions", json={"model": model, "prompt": "hello there",
                                                             "max_tokens": 4, "temperature": 0}, timeout=120)
    assert reply.status_code == 200, reply.text
    bad = httpx.post(f"{local.url}/v1/completions", json={"model": model, "prompt": "x", "max_tokens": -1}, timeout=30)
    assert bad.status_code == 400
    from pdserve_worker.roles.router_metrics import RouterMetrics

    return scraped(httpx.get(f"{local.url}/metrics", timeout=30).text, declared_labels(RouterMetrics().registry))


@pytest.fixture(scope="module")
def operator_series() -> dict[str, dict[str, set[str]]]:
    from kube_fake import fake_kube, service

    from netutil import free_port
    from pdserve_operator.broker_view import NullBrokerView
    from pdserve_operator.metrics import OperatorMetrics
    from pdserve_operator.reconcile import Reconciler
    from kube_fake import DEFAULTS

    kube = fake_kube()
    kube.inner.create(service("svc", "team", {}))
    metrics = OperatorMetrics()
    asyncio.run(Reconciler(kube, NullBrokerView(), DEFAULTS, metrics=metrics).request("team", "svc", "test"))
    port = free_port()
    server, thread = metrics.serve("127.0.0.1", port)
    try:
        return scraped(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text,
                       declared_labels(metrics.registry))
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
            extra = ROUTER_TARGET_LABELS if sel.metric.startswith("pdserve_router_") else TARGET_LABELS
            labels_of_expr |= have | extra
            for label, matchers in sel.matchers.items():
                if label not in have | extra:
                    problems.append(f"{sel.metric}: no label {label!r} (has {sorted(have)})")
                for op, value in matchers:
                    seen = series[sel.metric].get(label)
                    if seen and op == "Equal" and value not in seen:
                        problems.append(f"{sel.metric}{{{label}={value!r}}}: no such value "
                                        f"(seen {sorted(series[sel.metric][label])})")
        for label in use.grouping - labels_of_expr:
            problems.append(f"grouping label {label!r} is on none of the series of {expr!r}")
    return problems


def test_every_series_and_label_the_dashboard_and_rules_use_is_exposed(router_series, operator_series) -> None:
    series = {**router_series, **operator_series}
    exprs = dashboard_exprs() + rule_exprs()
    assert len(exprs) > 25
    assert missing(exprs, series) == []
    # The check can fail: a misspelt metric, label or bucket bound is reported.
    assert missing(['rate(pdserve_router_tokens_total[5m])'], series)
    assert missing(['sum by (decode) (pdserve_router_prompt_tokens_total)'], series)
    assert missing(['pdserve_router_time_to_first_token_seconds_bucket{le="2.4"}'], series)
    assert missing(['pdserve_operator_replicas_ready{rol="decode"}'], series)


def test_router_reports_members_and_in_flight_by_role(router_series) -> None:
    assert router_series["pdserve_router_members"]["role"] == {"prefill", "decode"}
    assert router_series["pdserve_router_requests_in_flight"]["role"] == {"prefill", "decode"}
    assert router_series["pdserve_router_requests_completed_total"]["mode"] == {"disaggregated"}


def test_operator_reports_replicas_by_role_and_reconciles(operator_series) -> None:
    assert operator_series["pdserve_operator_replicas_desired"]["role"] == {"prefill", "decode", "router"}
    assert operator_series["pdserve_operator_replicas_ready"]["pdis"] == {"svc"}
    assert operator_series["pdserve_operator_reconciles_total"]["result"] == {"ok", "invalid", "error"}
