"""tracing.py: off costs nothing and needs no OpenTelemetry; on, W3C context in and out, JSON lines;
spec.observability.tracing reaches every pod's environment."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve_common import pod_env as E
from pdserve_common import tracing
from pdserve_operator import spec as s
from pdserve_operator.reconcile.children import render
from pdserve_operator.reconcile.children.meta import Defaults, Owner

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def traced(tmp_path):
    path = tmp_path / "spans.jsonl"
    assert tracing.setup("pdserve-test", "t-1", env={E.TRACE_FILE: str(path)})
    yield path
    tracing.shutdown()


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def test_off_by_default_every_call_is_a_noop() -> None:
    assert not tracing.setup("pdserve-test", env={})
    assert not tracing.enabled()
    with tracing.span("x") as sp:
        sp.set_attribute("a", 1)
    assert tracing.start_span("y") is tracing.NOOP and not tracing.NOOP.is_recording()
    assert (
        tracing.inject() == {} and tracing.extract({"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}) is None
    )
    tracing.record("z", 1, 2)
    assert tracing.now_ns() == 0


def test_without_the_extra_it_stays_off_and_says_so(tmp_path) -> None:
    """The OpenTelemetry SDK made unimportable: asked for, tracing logs and serves without."""
    code = (
        "import sys, logging; logging.basicConfig(level=logging.INFO)\n"
        "sys.modules['opentelemetry'] = None\n"
        "from pdserve_common import tracing\n"
        f"assert tracing.setup('r', env={{'PDSERVE_TRACE_FILE': {str(tmp_path / 't.jsonl')!r}}}) is False\n"
        "assert not tracing.available() and not tracing.enabled()\n"
        "assert 'opentelemetry.sdk' not in sys.modules\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "tracing_unavailable" in out.stderr


def test_a_plain_import_does_not_load_opentelemetry() -> None:
    code = (
        "import sys; import pdserve_common.tracing, pdserve_common.channels; "
        "assert not [m for m in sys.modules if m.startswith('opentelemetry')], sorted(sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_sample_ratio_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="within \\[0, 1\\], got 1.5"):
        tracing.setup("x", env={E.TRACE_FILE: "/tmp/x", E.TRACING_SAMPLE_RATIO: "1.5"})


def test_traceparent_in_and_out_and_spans_as_json_lines(traced) -> None:
    incoming = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
    root = tracing.start_span("root", {"k": "v", "none": None}, parent=tracing.extract(incoming))
    with tracing.use(root):
        headers = tracing.inject()
        with tracing.span("child") as child:
            child.set_attribute("n", 3)
        tracing.record("timed", 1_000, 2_000, {"steps": 5})
    root.end()
    root.end()  # idempotent
    assert headers["traceparent"].startswith("00-4bf92f3577b34da6a3ce929d0e0e4736-")
    remote = tracing.extract([("traceparent", headers["traceparent"]), ("authorization", "Bearer x")])
    tracing.start_span("remote", parent=remote).end()
    tracing.shutdown()
    spans = {s["name"]: s for s in read(traced)}
    assert set(spans) == {"root", "child", "timed", "remote"}
    assert {s["trace_id"] for s in spans.values()} == {"4bf92f3577b34da6a3ce929d0e0e4736"}
    assert spans["root"]["parent_span_id"] == "00f067aa0ba902b7" and spans["root"]["attributes"] == {"k": "v"}
    assert spans["child"]["parent_span_id"] == spans["timed"]["parent_span_id"] == spans["root"]["span_id"]
    assert spans["remote"]["parent_span_id"] == headers["traceparent"].split("-")[2] == spans["root"]["span_id"]
    assert (spans["timed"]["start_ns"], spans["timed"]["end_ns"]) == (1_000, 2_000)
    assert spans["child"]["service"] == "pdserve-test" and spans["child"]["attributes"] == {"n": 3}


def test_a_malformed_traceparent_starts_a_new_trace(traced) -> None:
    tracing.start_span("r", parent=tracing.extract({"traceparent": "00-zz-00-01"})).end()
    tracing.shutdown()
    [span] = read(traced)
    assert span["parent_span_id"] is None and len(span["trace_id"]) == 32


def test_a_failing_block_marks_its_span(traced) -> None:
    with pytest.raises(RuntimeError):
        with tracing.span("fails"):
            raise RuntimeError("boom")
    tracing.shutdown()
    [span] = read(traced)
    assert span["status"] == "ERROR" and span["events"][0]["name"] == "exception"


def test_sampling_ratio_zero_records_nothing_and_follows_the_parent(tmp_path) -> None:
    path = tmp_path / "s.jsonl"
    tracing.setup("x", env={E.TRACE_FILE: str(path), E.TRACING_SAMPLE_RATIO: "0"})
    try:
        tracing.start_span("unsampled").end()
        sampled = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
        tracing.start_span("sampled-by-parent", parent=tracing.extract(sampled)).end()
    finally:
        tracing.shutdown()
    assert [s["name"] for s in read(path)] == ["sampled-by-parent"]


def test_spec_observability_tracing_reaches_every_pod() -> None:
    owner = Owner(name="svc", namespace="ns", uid="u")
    on = s.parse_spec({"observability": {"tracing": {"endpoint": "http://otel:4317", "sampleRatio": 0.25}}})
    off = s.parse_spec({})
    defaults = Defaults(image="img:1", broker_address="broker:50070")

    def envs(spec: s.PDInferenceServiceSpec) -> list[dict[str, str]]:
        out = []
        for obj in render(owner, spec, "tok", defaults):
            if obj["kind"] in ("Deployment", "StatefulSet"):
                container = obj["spec"]["template"]["spec"]["containers"][0]
                out.append({e["name"]: e.get("value") for e in container["env"]})
        return out

    assert len(envs(on)) == 3
    for env in envs(on):
        assert env[E.TRACING_ENDPOINT] == "http://otel:4317" and env[E.TRACING_SAMPLE_RATIO] == "0.25"
    for env in envs(off):
        assert E.TRACING_ENDPOINT not in env
    for bad in ({"endpoint": "otel:4317"}, {"endpoint": "http://otel:4317", "sampleRatio": 2}):
        with pytest.raises(ValueError):
            s.parse_spec({"observability": {"tracing": bad}})


def test_at_the_edge_a_clients_sampled_flag_does_not_force_recording(tmp_path) -> None:
    """The router: a client cannot make every request traced; the ratio decides by trace id."""
    path = tmp_path / "e.jsonl"
    tracing.setup("pdserve-router", env={E.TRACE_FILE: str(path), E.TRACING_SAMPLE_RATIO: "0"}, edge=True)
    try:
        sampled = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
        tracing.start_span("forced-by-client", parent=tracing.extract(sampled)).end()
    finally:
        tracing.shutdown()
    assert read(path) == []
    tracing.setup("pdserve-router", env={E.TRACE_FILE: str(path), E.TRACING_SAMPLE_RATIO: "1"}, edge=True)
    try:
        tracing.start_span("linked", parent=tracing.extract(sampled)).end()
    finally:
        tracing.shutdown()
    [span] = read(path)
    assert span["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736" and span["parent_span_id"] == "00f067aa0ba902b7"
