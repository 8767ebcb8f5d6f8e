"""Autoscaling pieces apart: the routers' signals, the spec's rules at admission, the rendered
HPA against the real autoscaling/v2 schema, and the reconciler leaving an autoscaler's field alone."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from support.kube_fake import fake_kube, reconcile, reconciler, service

ROOT = Path(__file__).resolve().parents[2]

from kube_emulator.schema import admit  # noqa: E402
from pdserve_operator import crd  # noqa: E402
from pdserve_operator import spec as s  # noqa: E402
from pdserve_operator.autoscale import inputs  # noqa: E402
from pdserve_operator.kube import KINDS  # noqa: E402
from pdserve_operator.planner import bundled_profile  # noqa: E402
from pdserve_operator.planner.model_shape import BUILTIN  # noqa: E402
from pdserve_operator.planner.profile import bundled_names  # noqa: E402
from pdserve_operator.planner.signals import LatencyHistogram, RouterReport, window  # noqa: E402
from pdserve_operator.reconcile.children import render  # noqa: E402
from pdserve_operator.reconcile.children.config_map import service_config  # noqa: E402
from pdserve_operator.reconcile.children.meta import Defaults, Owner  # noqa: E402
from pdserve_operator.reconcile.children.workloads import autoscaled_workloads, initial_replicas  # noqa: E402

NS = "team"


# ---- signals ----------------------------------------------------------------------------------


def hist(counts: tuple[int, ...], total: int, bounds: tuple[float, ...] = (0.1, 0.5, 1.0)) -> LatencyHistogram:
    return LatencyHistogram(bounds, counts, total)


def test_bucket_quantile_interpolates_as_promql_does() -> None:
    """Prometheus bucketQuantile (promql/quantile.go): rank q·total, linear inside the bucket it
    falls in, the first bucket starting at 0, the +Inf bucket answered with the top finite bound."""
    h = hist((10, 30, 40), 40)
    assert h.quantile(0.5) == pytest.approx(0.1 + 0.4 * (20 - 10) / 20)  # 0.3
    assert h.quantile(0.25) == pytest.approx(0.1 * 10 / 10)  # rank 10: the top of the first bucket
    assert h.quantile(0.1) == pytest.approx(0.1 * 4 / 10)
    assert h.quantile(1.0) == pytest.approx(1.0)
    assert hist((10, 30, 40), 50).quantile(0.99) == 1.0  # in +Inf: the highest finite bound
    assert hist((0, 0, 0), 0).quantile(0.9) is None
    with pytest.raises(ValueError):
        hist((10, 5, 40), 40)  # cumulative counts never decrease
    with pytest.raises(ValueError):
        LatencyHistogram((0.5, 0.1), (1, 2), 2)


def test_window_merges_routers_and_survives_a_restart() -> None:
    before = {
        "r1": RouterReport(100, 10_000, 2_000, hist((50, 90, 100), 100)),
        "r2": RouterReport(40, 4_000, 800, hist((40, 40, 40), 40)),
    }
    after = {
        "r1": RouterReport(130, 13_000, 2_600, hist((50, 110, 130), 130)),  # 30 new, all 0.1..1.0
        "r2": RouterReport(10, 1_000, 200, hist((10, 10, 10), 10)),  # restarted: 10 since then, all < 0.1
        "r3": RouterReport(500, 1, 1),
    }  # new: its counts since start are not this interval's
    w = window(before, after, 10.0, 0.5)
    assert w.request_rate == pytest.approx((30 + 10) / 10)
    assert w.prompt_tokens_mean == pytest.approx((3_000 + 1_000) / 40)
    assert w.output_tokens_mean == pytest.approx((600 + 200) / 40)
    merged = hist((10, 30, 40), 40)  # r1's 30 in (0.1, 0.5] and (0.5, 1.0], r2's 10 below 0.1
    assert w.samples == 40 and w.ttft_s == pytest.approx(merged.quantile(0.5))
    assert window({}, after, 10.0, 0.5).request_rate is None  # nobody reported twice yet


def test_a_rate_is_counted_over_the_reports_own_times_not_the_steps() -> None:
    """Keepalives every 0.5 s, a planner step every 1 s, a steady 3 requests/s: a step holds one
    to three keepalives' worth of counts. Over the step's interval that read 1.5 to 4.5 (the
    e2e autoscaling test once scaled up under a load meant to hold); over the reports' own
    times it reads 3 at every step."""
    rate, keepalive = 3.0, 0.5

    def report(received: float) -> RouterReport:
        return RouterReport(round(rate * received), 0, 0, at=received)

    steps = [1.0 + i + jitter for i, jitter in enumerate([0.0, 0.45, 0.05, 0.4, 0.1, 0.3])]
    # What each step sees: the last keepalive before it.
    seen = [report(keepalive * int(t / keepalive)) for t in steps]
    aliased, measured = [], []
    for (t0, a), (t1, b) in zip(zip(steps, seen), zip(steps[1:], seen[1:])):
        measured.append(window({"r": a}, {"r": b}, t1 - t0, 0.5).request_rate)
        aliased.append(window({"r": replace(a, at=None)}, {"r": replace(b, at=None)}, t1 - t0, 0.5).request_rate)
    assert measured == pytest.approx([rate] * len(measured))
    assert max(aliased) > 1.4 * rate or min(aliased) < 0.7 * rate, aliased  # what the step's interval gave


def test_a_router_with_no_newer_report_keeps_its_rate_and_an_idle_one_reads_zero() -> None:
    old = {"r1": RouterReport(100, 0, 0, at=10.0), "r2": RouterReport(50, 0, 0, at=10.2)}
    first = window(old, {"r1": RouterReport(120, 0, 0, at=12.0), "r2": RouterReport(54, 0, 0, at=12.2)}, 2.0, 0.5)
    assert first.rates == pytest.approx({"r1": 10.0, "r2": 2.0}) and first.request_rate == pytest.approx(12.0)
    now = {"r1": RouterReport(130, 0, 0, at=13.0), "r2": RouterReport(54, 0, 0, at=12.2)}  # r2: no keepalive since
    second = window(
        {"r1": RouterReport(120, 0, 0, at=12.0), "r2": RouterReport(54, 0, 0, at=12.2)}, now, 1.0, 0.5, first.rates
    )
    assert second.rates == pytest.approx({"r1": 10.0, "r2": 2.0}), "r2 sent nothing newer: not 0, its last rate"
    idle = window(
        now, {"r1": RouterReport(130, 0, 0, at=14.0), "r2": RouterReport(54, 0, 0, at=13.9)}, 1.0, 0.5, second.rates
    )
    assert idle.request_rate == 0.0, "keepalives with unchanged counters are a rate of 0"
    assert window(now, now, 1.0, 0.5).request_rate is None, "nothing newer and nothing carried: unknown"


def test_router_load_reports_what_metrics_show_and_survives_the_wire() -> None:
    from pdserve_common.membership import load_from_proto, load_to_proto
    from pdserve_worker.api.metrics import RequestTiming, RouterMetrics
    from pdserve_worker.router.load import router_load

    metrics = RouterMetrics()
    metrics.observe_completed(RequestTiming(0.0, 0.3, 1.3, 1.4, 11), 7, None)
    metrics.observe_failed("timeout")
    load = router_load(metrics)
    assert load.router is not None and (
        load.router.requests_total,
        load.router.prompt_tokens_total,
        load.router.output_tokens_total,
    ) == (2, 7, 11)
    report = inputs.router_report(load_from_proto(load_to_proto(load)))
    assert report is not None and report.ttft is not None and report.ttft.count == 1
    assert 0.25 <= report.ttft.quantile(0.5) <= 0.5  # the 0.3 s TTFT, within its bucket (0.25, 0.5]
    # A malformed report (counts that decrease) is dropped at the broker's door, not trusted.
    msg = load_to_proto(load)
    msg.router.ttft.counts[0] = 5
    assert load_from_proto(msg).router.ttft is None
    msg.router.ttft.bounds.extend([float(i) for i in range(100, 170)])
    assert load_from_proto(msg).router.ttft is None


# ---- spec: the API server's view and ours ------------------------------------------------------


def base(**autoscaling: Any) -> dict[str, Any]:
    return {"autoscaling": {"slo": {"ttftMs": 1000}, **autoscaling}}


def admitted(spec: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """What the API server stores, and its errors (the emulator's port of apiextensions' admission)."""
    schema = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    stored, errors = admit(
        {"apiVersion": s.API_VERSION, "kind": s.KIND, "metadata": {"name": "x"}, "spec": spec}, schema
    )
    return stored, [str(e) for e in errors]


REFUSED = [
    (base(decode={"enabled": True, "minReplicas": 5, "maxReplicas": 2}), "minReplicas must not exceed maxReplicas"),
    (base(decode={"enabled": True, "driver": "hpa"}), "metric is required with driver hpa"),
    (
        base(
            decode={
                "enabled": True,
                "metric": {
                    "type": "Resource",
                    "name": "cpu",
                    "target": {"type": "Utilization", "averageUtilization": 60},
                },
            }
        ),
        "metric is required with driver hpa",
    ),
    (
        base(
            prefill={
                "enabled": True,
                "driver": "hpa",
                "metric": {"type": "Pods", "name": "q", "target": {"type": "Utilization", "averageUtilization": 50}},
            }
        ),
        "a Pods metric's target is AverageValue",
    ),
    (
        base(
            prefill={
                "enabled": True,
                "driver": "hpa",
                "metric": {"type": "Resource", "name": "cpu", "target": {"type": "Value", "value": "2"}},
            }
        ),
        "a Resource metric's target is Utilization or AverageValue",
    ),
    (
        base(
            prefill={
                "enabled": True,
                "driver": "hpa",
                "metric": {"type": "Pods", "name": "q", "target": {"type": "AverageValue", "value": "2"}},
            }
        ),
        "set exactly the value of the target's type",
    ),
    (base(ratio={"minPrefillPerDecode": 2, "maxPrefillPerDecode": 1}), "minPrefillPerDecode must not exceed"),
    ({"autoscaling": {"decode": {"enabled": True}}}, "the planner needs slo.ttftMs or slo.tpotMs"),
    (
        {**base(decode={"enabled": True, "maxReplicas": 2}), "decode": {"replicas": 3}},
        "decode.replicas (the floor while autoscaling) must not exceed autoscaling.decode.maxReplicas",
    ),
    (
        {**base(decode={"enabled": True, "driver": "external"}), "decode": {"layerShards": 2}},
        "with decode.layerShards > 1 only the planner scales decode",
    ),
]


@pytest.mark.parametrize(("spec", "message"), REFUSED)
def test_the_api_server_and_the_operator_refuse_the_same_specs(spec: dict[str, Any], message: str) -> None:
    _, errors = admitted(spec)
    assert any(message in e for e in errors), errors
    with pytest.raises(s.ValidationError) as err:
        s.parse_spec(spec)
    assert message in s.describe(err.value)


def test_an_autoscaled_spec_is_stored_with_its_defaults_and_parses_back() -> None:
    stored, errors = admitted(base(decode={"enabled": True}))
    assert errors == []
    a = stored["spec"]["autoscaling"]
    assert a["decode"] == {"enabled": True, "driver": "planner", "minReplicas": 1, "maxReplicas": 8}
    assert a["scaleDownWindowSeconds"] == 300 and a["slo"]["percentile"] == 90
    assert s.parse_spec(stored["spec"]).autoscaling == s.parse_spec(base(decode={"enabled": True})).autoscaling
    stored, _ = admitted({})
    assert "autoscaling" not in stored["spec"]  # off unless asked for: nothing defaulted in


@pytest.mark.parametrize(
    "metric",
    [
        {"type": "Resource", "name": "cpu", "target": {"type": "Utilization", "averageUtilization": 70}},
        {
            "type": "Pods",
            "name": "pdserve_prefill_queue_length",
            "target": {"type": "AverageValue", "averageValue": "4"},
        },
        {"type": "External", "name": "q", "selector": {"queue": "llm"}, "target": {"type": "Value", "value": "10"}},
    ],
)
def test_every_valid_metric_kind_is_admitted(metric: dict[str, Any]) -> None:
    spec = base(prefill={"enabled": True, "driver": "hpa", "metric": metric})
    assert admitted(spec)[1] == []
    assert s.parse_spec(spec).autoscaling.prefill.metric is not None
    with_selector = {**metric, "selector": {"a": "b"}}
    refused = admitted(base(prefill={"enabled": True, "driver": "hpa", "metric": with_selector}))[1]
    assert any("a Resource metric takes no selector" in e for e in refused) == (metric["type"] == "Resource")


def test_a_model_the_planner_cannot_size_is_marked_invalid_by_the_operator() -> None:
    spec = {**base(decode={"enabled": True}), "model": {"source": "pvc://models/qwen"}}
    assert admitted(spec)[1] == []  # the API server cannot know
    with pytest.raises(s.ValidationError) as err:
        s.parse_spec(spec)
    assert "autoscaling.plannerModel" in s.describe(err.value)
    spec["autoscaling"]["plannerModel"] = "llama-7b"
    assert s.planner_model_name(s.parse_spec(spec)) == "llama-7b"


def test_planner_names_in_the_spec_are_the_planners() -> None:
    assert set(s.PLANNER_MODELS) <= set(BUILTIN) and set(s.PLANNER_PROFILES) <= set(bundled_names())
    assert bundled_profile("cpu-reference").device == "cpu"


# ---- rendering -------------------------------------------------------------------------------


OWNER = Owner("svc", NS, "uid-1")


@pytest.mark.parametrize(
    "metric",
    [
        {"type": "Resource", "name": "cpu", "target": {"type": "Utilization", "averageUtilization": 70}},
        {
            "type": "Pods",
            "name": "pdserve_decode_kv_slots_used",
            "target": {"type": "AverageValue", "averageValue": "6"},
        },
        {
            "type": "External",
            "name": "queue_depth",
            "selector": {"queue": "llm"},
            "target": {"type": "Value", "value": "100"},
        },
    ],
)
def test_rendered_hpa_is_a_valid_autoscaling_v2_object(metric: dict[str, Any]) -> None:
    spec = s.parse_spec(
        {
            **base(decode={"enabled": True, "driver": "hpa", "minReplicas": 2, "maxReplicas": 6, "metric": metric}),
            "decode": {"replicas": 3},
        }
    )
    [hpa] = [o for o in render(OWNER, spec, "tok", Defaults("i", "b:1")) if o["kind"] == "HorizontalPodAutoscaler"]
    kubernetes_validate.validate(hpa, "1.30.0", strict=True)  # the real schema; raises naming the field
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "svc-decode"}
    assert hpa["spec"]["minReplicas"] == 3  # the floor: max(minReplicas, decode.replicas)
    assert hpa["spec"]["metrics"][0]["type"] == metric["type"]


def test_autoscaled_workloads_start_at_their_floor() -> None:
    spec = s.parse_spec(
        {
            **base(
                prefill={"enabled": True, "minReplicas": 2, "maxReplicas": 4},
                decode={"enabled": True, "driver": "external"},
            ),
            "prefill": {"replicas": 1},
            "decode": {"replicas": 3},
        }
    )
    assert initial_replicas(spec, "prefill") == 2  # planner: max(minReplicas, replicas)
    assert initial_replicas(spec, "decode") == 3  # external: the spec's count, at creation only
    assert autoscaled_workloads("svc", spec) == {("Deployment", "svc-prefill"), ("StatefulSet", "svc-decode")}
    assert autoscaled_workloads("svc", s.parse_spec({})) == set()
    assert "autoscaling" not in service_config(spec)  # changing who scales rolls no pod


def test_p_d_band_holds_against_the_decode_that_is_there() -> None:
    spec = s.parse_spec(
        base(
            prefill={"enabled": True, "maxReplicas": 8},
            decode={"enabled": True},
            ratio={"minPrefillPerDecode": 0.5, "maxPrefillPerDecode": 2},
        )
    )
    assert spec.autoscaling is not None
    assert inputs.in_band(1, 3, spec.autoscaling, spec) == 2  # ceil(0.5 * 3)
    assert inputs.in_band(8, 3, spec.autoscaling, spec) == 6
    assert inputs.in_band(3, 3, spec.autoscaling, spec) == 3


# ---- reconciling: an autoscaler's field is not ours -------------------------------------------


@pytest.mark.parametrize("autoscaling", [False, True])
def test_the_reconciler_writes_replicas_only_where_no_autoscaler_owns_them(autoscaling: bool) -> None:
    spec = {"decode": {"replicas": 2}}
    if autoscaling:
        spec.update(base(decode={"enabled": True, "driver": "external"}))
    kube = fake_kube()
    kube.inner.create({**service("svc", NS, spec), "metadata": {"name": "svc", "namespace": NS, "uid": "uid-1"}})
    rec = reconciler(kube)
    reconcile(rec, NS, "svc")
    sts = KINDS["StatefulSet"]
    assert kube.inner.get(sts, NS, "svc-decode")["spec"]["replicas"] == 2  # created with the spec's count
    kube.inner.merge_patch(sts, NS, "svc-decode", {"spec": {"replicas": 5}})  # an HPA, KEDA, ...
    kube.clear()
    reconcile(rec, NS, "svc")
    sts_writes = [a.short() for a in kube.writes() if a.kind == "StatefulSet"]
    replicas = kube.inner.get(sts, NS, "svc-decode")["spec"]["replicas"]
    if autoscaling:
        assert sts_writes == [] and replicas == 5
    else:
        assert sts_writes == ["patch StatefulSet/svc-decode"] and replicas == 2  # drift: reverted
