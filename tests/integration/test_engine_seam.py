"""The engine seam (engines/): an engine package outside pdserve serves a PD request.

The package registers itself with one line of its own metadata (an entry point in the
`pdserve.engines` group, written here as an installed distribution would have it) and
`PDSERVE_ENGINE=fake` names it; no product file mentions it. The prefill and decode of a real
`pdserve local` load it through engines/registry.py and serve through it. Its tokens are right
only if every layer chunk its prefill wrote reached the decode's blocks (support/fake_engine.py),
so the answer proves the PD path, not just the load. `module:Class` and an in-tree registry line
reach the same class.
"""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest

from pdserve_worker.engines.base import EngineError, EngineLoad
from pdserve_worker.engines.native import NativeEngine
from pdserve_worker.engines.registry import ENGINES, engine_type, installed_engines, load_engine
from support.fake_engine import FakeEngine, expected

FAKE = "support.fake_engine:FakeEngine"


def request(source: str | None, **extra) -> EngineLoad:
    return EngineLoad(source=source, dtype="float32", device="cpu", weights="auto", max_length=64, **extra)


def test_the_registry_names_the_native_engine_and_takes_a_module_path():
    assert engine_type("native") is NativeEngine
    assert engine_type(FAKE) is FakeEngine


def installed(site: Path, name: str, target: str) -> Path:
    """`site` holds a distribution whose one entry point registers engine `name` as `target`."""
    dist = site / "pdserve_fake_engine-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: pdserve-fake-engine\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[pdserve.engines]\n{name} = {target}\n")
    return site


def test_an_installed_package_registers_its_engine_by_entry_point(monkeypatch, tmp_path):
    with pytest.raises(EngineError, match="'fake' is not registered"):
        engine_type("fake")
    monkeypatch.syspath_prepend(str(installed(tmp_path / "site", "fake", FAKE)))
    assert engine_type("fake") is FakeEngine and installed_engines() == {"fake": FAKE}
    # A package cannot take a built-in name, nor register what is not module:Class.
    monkeypatch.syspath_prepend(str(installed(tmp_path / "other", "native", FAKE)))
    assert engine_type("native") is NativeEngine and "native" not in installed_engines()
    monkeypatch.syspath_prepend(str(installed(tmp_path / "bad", "broken", "support.fake_engine")))
    with pytest.raises(EngineError, match="'broken' is registered as 'support.fake_engine'; expected module:Class"):
        engine_type("broken")


def test_one_registry_line_names_an_engine_package(monkeypatch, tiny_model_dir):
    """The registry's way in: one line in ENGINES (here set by the test), then the name loads it."""
    with pytest.raises(EngineError, match="'fake' is not registered"):
        engine_type("fake")
    monkeypatch.setitem(ENGINES, "fake", FAKE)
    assert engine_type("fake") is FakeEngine
    engine = load_engine("fake", request(str(tiny_model_dir)))
    assert isinstance(engine, FakeEngine) and engine.name == f"fake-{tiny_model_dir.name}"


@pytest.mark.parametrize(
    ("name", "said"),
    [
        ("vllm-but-not-registered", "is not registered; expected one of ['native', 'vllm'] or module:Class"),
        ("support.no_such_module:Engine", "cannot import support.no_such_module:Engine"),
        ("support.fake_engine:NoSuchClass", "cannot import support.fake_engine:NoSuchClass"),
    ],
)
def test_an_engine_that_cannot_be_found_is_refused_by_name(name, said):
    with pytest.raises(EngineError, match="engine .*" + re.escape(said)):
        engine_type(name)


@pytest.mark.parametrize(
    ("extra", "what"), [({"tp": (2, 0)}, "tensor_parallel"), ({"layers": range(0, 1)}, "layer_shards")]
)
def test_an_engine_without_groups_is_refused_a_group_before_it_loads(extra, what):
    # No model folder: loading would fail with its own error, so the capability's refusal
    # can only come from the check that runs before the load.
    with pytest.raises(EngineError, match="needs a model folder"):
        load_engine(FAKE, request(None))
    with pytest.raises(EngineError, match=f"engine '{FAKE}' does not run {what}"):
        load_engine(FAKE, request(None, **extra))


def test_a_fake_engine_package_serves_a_pd_request(tiny_model_dir, tmp_path, monkeypatch, local_deployments):
    # The children inherit both; cli_env() puts tests/ (the package's code) on their path too.
    monkeypatch.setenv("PYTHONPATH", str(installed(tmp_path / "site", "fake", FAKE)))
    monkeypatch.setenv("PDSERVE_ENGINE", "fake")
    run = local_deployments(tmp_path / "run", tiny_model_dir, decode=1, slots=2, max_len=64, layers_per_chunk=1)
    try:
        engine = FakeEngine.load(request(str(tiny_model_dir)))
        prompt = [5, 17, 230, 41, 9, 77]
        body = {
            "model": json.loads(urllib.request.urlopen(f"{run.url}/v1/models", timeout=30).read())["data"][0]["id"],
            "prompt": prompt,
            "max_tokens": 12,
            "temperature": 0,
            "ignore_eos": True,
            "skip_special_tokens": False,
        }
        call = urllib.request.Request(
            f"{run.url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"content-type": "application/json", "x-pdserve-debug": "workers"},
        )
        answer = json.loads(urllib.request.urlopen(call, timeout=60).read())
    finally:
        run.stop_cleanly()
    want = expected(prompt, 12, engine.config.vocab_size)
    assert answer["choices"][0]["text"] == engine.tokenizer.decode(want)
    assert answer["pdserve"]["disaggregated"] is True
    assert answer["pdserve"]["kv_bytes"] > 0
