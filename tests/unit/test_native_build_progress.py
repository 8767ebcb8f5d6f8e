"""The native kernels say what they are and what they do (#56 items 4 and 5): `pdserve info`
names the ISA and each op's path on this CPU, and a launcher's first build says it is compiling
and for how long, instead of the workers waiting on it silently."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve_worker.model.layers import native


@pytest.fixture
def unbuilt(monkeypatch, tmp_path):
    """A library that is not built yet (an empty cache), with the compile replaced."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(native.ENV, raising=False)
    built = []

    def fake_build(verbose: bool = False) -> str:
        built.append(True)
        return "fake"

    monkeypatch.setattr(native, "build", fake_build)
    return built


def test_a_first_build_says_it_is_compiling_for_which_isa_and_how_long(unbuilt):
    said: list[str] = []
    native.prepare(said.append)
    assert unbuilt == [True]
    isa = native._library().isa
    assert (
        said[0].startswith(f"compiling native kernels for {isa}, once per machine") and native.BUILD_ESTIMATE in said[0]
    )
    assert said[1].startswith("native kernels built in ")


def test_a_failed_build_is_said_and_a_torch_choice_builds_nothing(unbuilt, monkeypatch):
    def broken(verbose: bool = False) -> str:
        raise RuntimeError("no g++")

    monkeypatch.setattr(native, "build", broken)
    said: list[str] = []
    native.prepare(said.append)
    assert "native kernels not built (RuntimeError('no g++'))" in said[-1]
    monkeypatch.setenv(native.ENV, "torch")
    said.clear()
    native.prepare(said.append)
    assert said == []
    assert native.describe()["paths"] == f"torch's ops ({native.ENV}=torch)"


def test_an_unbuilt_library_is_described_without_compiling(unbuilt):
    described = native.describe()
    assert described["built"] is False and "not known until built" in str(described["paths"])
    assert unbuilt == []  # (describe never builds)
    assert Path(str(described["cache"])).parent.parent == Path(native._cache_root()).parent


def test_info_names_the_isa_and_each_ops_path_where_the_kernels_are_built():
    if not native.available():
        pytest.skip("the native kernels do not build here: describe() says so (the test above)")
    out = subprocess.run(
        [sys.executable, "-m", "pdserve_worker.cli.main", "info"], capture_output=True, text=True, check=True
    )
    kernels = json.loads(out.stdout)["cpu"]["native_kernels"]
    assert kernels["built"] is True and kernels["isa"] == native._library().isa
    paths = kernels["paths"]
    assert set(paths) == {
        "decode_attention",
        "layer_ops",
        "prefill_attention_bf16",
        "prefill_attention_fp32",
        "dense_fp32_matmul",
        "quantized_matmul",
    }
    assert paths["prefill_attention_bf16"].startswith("native") == native._bf16_dot()
    assert paths["dense_fp32_matmul"].startswith("native") == native.dense_serves()
