"""The chart's Grafana dashboard and PrometheusRule: opt-in, valid to the upstreams' own rules.

- The rules pass `promcheck.rule_file_errors`, a port of prometheus/prometheus
  model/rulefmt/rulefmt.go (`Parse`, `RuleGroups.Validate`, `Rule.Validate`) with every expr
  parsed by a port of the Prometheus PromQL parser; the refusals are tested too, so the check
  is not empty.
- The dashboard validates against tests/grafana_dashboard.schema.json, a port of grafana/grafana
  kinds/dashboard/dashboard_kind.cue (closed definitions: an unknown key is refused).
- Whether the metric names and labels they use exist is the integration test's job
  (tests/integration/test_observability.py scrapes a running deployment).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

ROOT = Path(__file__).resolve().parents[2]

import promcheck  # noqa: E402
from chart_tools import CHART, by_kind, render  # noqa: E402

ON = ["--set", "prometheusRule.enabled=true", "--set", "dashboards.enabled=true"]
SCHEMA = json.loads((ROOT / "tests" / "grafana_dashboard.schema.json").read_text())


def dashboard() -> dict[str, Any]:
    return json.loads((CHART / "dashboards" / "pdserve.json").read_text())


def rules() -> dict[str, Any]:
    [rule] = by_kind(render(*ON), "PrometheusRule")
    return rule["spec"]


def schema_errors(doc: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft202012Validator(SCHEMA)
    return [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(doc)]


# ---- opt-in ------------------------------------------------------------------------------------


def test_dashboard_and_rules_are_off_by_default_and_on_when_asked() -> None:
    assert not [
        o for o in render() if o["kind"] in ("PrometheusRule",) or o["metadata"]["name"].endswith("-dashboards")
    ]
    objects = render(*ON, "--set", "dashboards.annotations.grafana_folder=LLM")
    [cm] = [o for o in by_kind(objects, "ConfigMap") if o["metadata"]["name"].endswith("-dashboards")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"  # the grafana chart sidecar's default label
    assert cm["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    assert json.loads(cm["data"]["pdserve.json"]) == dashboard()  # the file, byte for byte as JSON
    other = render(*ON, "--set", "dashboards.namespace=monitoring", "--set", "dashboards.sidecarLabel=dash")
    [cm] = [o for o in by_kind(other, "ConfigMap") if o["metadata"]["name"].endswith("-dashboards")]
    assert cm["metadata"]["namespace"] == "monitoring" and cm["metadata"]["labels"]["dash"] == "1"
    assert len(by_kind(objects, "PrometheusRule")) == 1


def test_operator_serves_metrics_and_the_monitors_scrape_it_and_label_routers_by_service() -> None:
    objects = render("--set", "serviceMonitor.enabled=true")
    container = by_kind(objects, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["PDSERVE_OPERATOR_METRICS_PORT"] == "8081"
    assert {"name": "metrics", "containerPort": 8081, "protocol": "TCP"} in container["ports"]
    [service] = by_kind(objects, "Service")
    assert any(p["name"] == "metrics" and p["targetPort"] == "metrics" for p in service["spec"]["ports"])
    [policy] = by_kind(objects, "NetworkPolicy")
    assert {"port": 8081, "protocol": "TCP"} in policy["spec"]["ingress"][1]["ports"]
    routers, operator = sorted(by_kind(objects, "ServiceMonitor"), key=lambda m: m["metadata"]["name"], reverse=True)
    assert routers["metadata"]["name"].endswith("-routers") and operator["metadata"]["name"].endswith("-operator")
    # The dashboard and the alerts group the routers' series by `pdis`: this relabeling makes it.
    assert routers["spec"]["endpoints"][0]["relabelings"] == [
        {"sourceLabels": ["__meta_kubernetes_service_label_app_kubernetes_io_instance"], "targetLabel": "pdis"}
    ]
    assert operator["spec"]["endpoints"][0]["port"] == "metrics"
    [pods] = by_kind(objects, "PodMonitor")
    assert pods["spec"]["podMetricsEndpoints"][0]["relabelings"] == [
        {"sourceLabels": ["__meta_kubernetes_pod_label_app_kubernetes_io_instance"], "targetLabel": "pdis"}
    ]
    assert operator["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
    assert operator["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()


# ---- the rules: promtool's checks, ported ------------------------------------------------------


def test_rules_pass_the_ported_promtool_checks() -> None:
    spec = rules()
    assert promcheck.rule_file_errors(spec) == []
    alerts = {r["alert"] for g in spec["groups"] for r in g["rules"]}
    assert alerts >= {
        "PdserveSLOBurnTTFTFast",
        "PdserveSLOBurnTTFTSlow",
        "PdserveSLOBurnTPOTFast",
        "PdserveSLOBurnTPOTSlow",
        "PdserveKVSaturated",
        "PdserveKVTransferFailures",
        "PdserveNoReadyPrefill",
        "PdserveNoReadyDecode",
        "PdserveReconcileErrors",
        "PdserveKVTransferFailuresOnWorkers",
        "PdservePrefillQueueBacklog",
    }


def test_slo_thresholds_come_from_values() -> None:
    [rule] = by_kind(
        render(*ON, "--set-string", "prometheusRule.ttft.le=1.0", "--set-json", "prometheusRule.ttft.objective=0.95"),
        "PrometheusRule",
    )
    fast = next(r for g in rule["spec"]["groups"] for r in g["rules"] if r["alert"] == "PdserveSLOBurnTTFTFast")
    assert 'le="1.0"' in fast["expr"] and "> 0.72" in fast["expr"]  # 14.4 x (1 - 0.95)
    assert promcheck.rule_file_errors(rule["spec"]) == []


def _one_alert(**change: Any) -> dict[str, Any]:
    rule = {
        "alert": "A",
        "expr": "up == 0",
        "for": "5m",
        "labels": {"severity": "page"},
        "annotations": {"summary": "{{ $labels.job }} is down"},
    }
    rule.update(change)
    return {"groups": [{"name": "g", "rules": [{k: v for k, v in rule.items() if v is not None}]}]}


@pytest.mark.parametrize(
    ("doc", "error"),
    [
        ({"groups": [{"name": "", "rules": []}]}, "Groupname must not be empty"),
        ({"groups": [{"name": "g", "rules": []}, {"name": "g", "rules": []}]}, 'groupname: "g" is repeated'),
        ({"groups": [{"name": "g", "rulez": []}]}, "field rulez not found"),
        ({"groups": [{"name": "g", "interval": "5 minutes", "rules": []}]}, "not a valid duration"),
        (_one_alert(record="r"), "only one of 'record' and 'alert' must be set"),
        (_one_alert(alert=None), "one of 'record' or 'alert' must be set"),
        (_one_alert(expr=None), "field 'expr' must be set"),
        (_one_alert(expr="sum(rate(up[5m])"), "could not parse expression"),
        (_one_alert(expr="rate(up[5x])"), "could not parse expression"),
        (_one_alert(**{"for": "1hour"}), "not a valid duration"),
        (_one_alert(labels={"bad-name": "x"}), "invalid label name: bad-name"),
        (_one_alert(labels={"__name__": "x"}), "invalid label name: __name__"),
        (_one_alert(annotations={"summary": "{{ $labels.job }"}), "unclosed action"),
        (_one_alert(annotations={"summary": "{{ $lables.job }}"}), "undefined variable '$lables'"),
        (_one_alert(severity="x"), "field severity not found"),
        (
            {"groups": [{"name": "g", "rules": [{"record": "a:b", "expr": "up", "for": "5m"}]}]},
            "invalid field 'for' in recording rule",
        ),
        (
            {"groups": [{"name": "g", "rules": [{"record": "a:b", "expr": "up", "annotations": {"a": "b"}}]}]},
            "invalid field 'annotations' in recording rule",
        ),
        ({"groups": [{"name": "g", "rules": [{"record": "a-b", "expr": "up"}]}]}, "invalid recording rule name"),
        ({"groups": [{"name": "g", "rules": [{"record": "a{b}", "expr": "up"}]}]}, "braces present"),
    ],
)
def test_rule_checks_refuse_what_promtool_refuses(doc: dict[str, Any], error: str) -> None:
    errors = promcheck.rule_file_errors(doc)
    assert any(error in e for e in errors), errors


def test_a_valid_rule_file_passes_the_checks() -> None:
    assert promcheck.rule_file_errors(_one_alert()) == []
    assert (
        promcheck.rule_file_errors(
            {
                "groups": [
                    {
                        "name": "g",
                        "interval": "1m30s",
                        "rules": [{"record": "job:up:sum", "expr": "sum by (job) (up)", "labels": {"team": "a"}}],
                    }
                ]
            }
        )
        == []
    )


# ---- the dashboard: Grafana's schema, ported ---------------------------------------------------


def test_dashboard_loads_in_grafanas_schema_and_every_query_parses() -> None:
    board = dashboard()
    assert schema_errors(board) == []
    variables = [v["name"] for v in board["templating"]["list"]]
    panels = [p for row in board["panels"] for p in [row, *row.get("panels", [])]]
    exprs = [t["expr"] for p in panels for t in p.get("targets", [])]
    assert len(exprs) >= 15
    for expr in exprs:
        promcheck.uses(promcheck.grafana_expr(expr, variables))  # raises on a query that does not parse
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in panels:  # panels side by side never overlap
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]


@pytest.mark.parametrize(
    ("change", "where"),
    [
        (lambda b: b["panels"][1].__setitem__("titel", "x"), "Additional properties"),
        (lambda b: b["panels"][1]["gridPos"].__setitem__("w", 25), "25"),
        (lambda b: b["panels"][1].__delitem__("type"), "'type' is a required property"),
        (lambda b: b.__setitem__("graphTooltip", 3), "3"),
        (lambda b: b["templating"]["list"][1].__delitem__("hide"), "'hide' is a required property"),
        (lambda b: b["templating"]["list"][1].__setitem__("type", "dropdown"), "dropdown"),
        (lambda b: b["panels"][0].__delitem__("id"), "'id' is a required property"),
        (lambda b: b.__setitem__("dashboardTitle", "x"), "Additional properties"),
    ],
)
def test_dashboard_schema_refuses_what_grafanas_refuses(change: Any, where: str) -> None:
    board = copy.deepcopy(dashboard())
    change(board)
    errors = schema_errors(board)
    assert any(where in e for e in errors), errors


def test_promql_uses_finds_metrics_matchers_and_grouping() -> None:
    use = promcheck.uses('sum by (le, pdis) (rate(a_bucket{le="2.5", pdis=~".*"}[5m])) / on (x) group_left (y) b')
    assert [(s.metric, sorted(s.matchers)) for s in use.selectors] == [("a_bucket", ["le", "pdis"]), ("b", [])]
    assert use.grouping == {"le", "pdis", "x", "y"}
    assert promcheck.grafana_expr('rate(a{pdis=~"$pdis"}[$__rate_interval])', ["pdis"]) == 'rate(a{pdis=~".*"}[5m])'
    with pytest.raises(ValueError, match="unknown variable"):
        promcheck.grafana_expr('rate(a{x=~"$other"}[5m])', ["pdis"])
    with pytest.raises(ValueError):
        promcheck.uses("rate(a[5m]")
