"""The engine registry (engines/registry.py): `vllm` is a name, and an engine that is not
installed is refused naming the engine, the missing module and the step that installs it: by a
launcher's check, when the class is looked up, and when it loads.

Two ways an engine is missing, both made real here whatever this machine has: its module does
not import (`None` in sys.modules fails an import as an absent module does), or its
`check_installed()` finds what it runs elsewhere missing (vLLM lives in its own environment).
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from pdserve_worker.engines import registry
from pdserve_worker.engines.base import EngineError, EngineLoad
from pdserve_worker.engines.registry import check_engine, engine_type, load_engine

FIX = "bash scripts/setup.sh --engine vllm"
VLLM_ENGINE = "pdserve_worker.engines.vllm.engine"


def _request() -> EngineLoad:
    return EngineLoad(source=None, dtype="float32", device="cpu", weights="auto", max_length=64)


def _engine_module(folder: Path, name: str, body: str) -> str:
    (folder / f"{name}.py").write_text(textwrap.dedent(body))
    return f"{name}:Engine"


CALLS = [check_engine, engine_type, lambda n: load_engine(n, _request())]


def test_vllm_is_a_registered_engine_with_its_set_up_step():
    assert registry.ENGINES["vllm"] == f"{VLLM_ENGINE}:VllmEngine"
    assert registry.DEFAULT == "native"
    assert registry.SETUP["vllm"] == FIX
    check_engine("native")  # installed here: no refusal


@pytest.mark.parametrize("call", CALLS)
def test_vllm_whose_module_cannot_import_is_refused_naming_engine_module_and_fix(monkeypatch, call):
    monkeypatch.setitem(sys.modules, VLLM_ENGINE, None)
    with pytest.raises(EngineError) as caught:
        call("vllm")
    assert str(caught.value) == (
        f"engine 'vllm': cannot import {VLLM_ENGINE}:VllmEngine: module '{VLLM_ENGINE}' is not installed; "
        f"to install it run `{FIX}`"
    )


@pytest.mark.parametrize("call", CALLS)
def test_vllm_whose_check_finds_no_vllm_is_refused_before_it_loads(tmp_path, monkeypatch, call):
    """The engine imports, but what it runs elsewhere is missing: its check_installed says so."""
    monkeypatch.syspath_prepend(str(tmp_path))
    _engine_module(
        tmp_path,
        "vllm_engine_without_vllm",
        """
        class Engine:
            capabilities = frozenset()

            @classmethod
            def check_installed(cls):
                raise ModuleNotFoundError("No module named 'vllm'", name="vllm")

            @classmethod
            def load(cls, request):
                raise AssertionError("loaded although not installed")
        """,
    )
    monkeypatch.setitem(registry.ENGINES, "vllm", "vllm_engine_without_vllm:Engine")
    if call is engine_type:  # the lookup alone does not run the check
        assert call("vllm").__name__ == "Engine"
        return
    with pytest.raises(EngineError) as caught:
        call("vllm")
    assert "engine 'vllm': " in str(caught.value) and "module 'vllm' is not installed" in str(caught.value)
    assert f"run `{FIX}`" in str(caught.value)


def test_an_unregistered_engine_is_refused_by_the_check_as_by_the_lookup():
    for call in (check_engine, engine_type):
        with pytest.raises(EngineError, match=r"engine 'vlm' is not registered; expected one of \['native', 'vllm'\]"):
            call("vlm")


def test_a_module_path_engine_missing_a_dependency_names_it(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    at_import = _engine_module(tmp_path, "engine_needs_lib", "import no_such_lib_for_pdserve_test\nclass Engine: ...\n")
    late = _engine_module(
        tmp_path,
        "engine_needs_lib_late",
        """
        class Engine:
            capabilities = frozenset()

            @classmethod
            def check_installed(cls):
                pass

            @classmethod
            def load(cls, request):
                import no_such_late_lib_for_pdserve_test
        """,
    )
    for call in (check_engine, engine_type):
        with pytest.raises(EngineError) as caught:
            call(at_import)
        assert "module 'no_such_lib_for_pdserve_test' is not installed" in str(caught.value)
        assert "install the package that provides 'no_such_lib_for_pdserve_test'" in str(caught.value)
    check_engine(late)  # it imports, and has nothing to check before loading
    with pytest.raises(EngineError, match="module 'no_such_late_lib_for_pdserve_test' is not installed"):
        load_engine(late, _request())


def test_the_real_vllm_entry_names_its_environment_or_what_is_not_built(tmp_path, monkeypatch):
    """engines/vllm/engine.py: no vLLM environment is the set-up refusal; with one, the refusal
    says the worker that fronts vLLM is not built (the connector runs inside vLLM servers)."""
    monkeypatch.setenv("PDSERVE_VLLM_PYTHON", str(tmp_path / "absent" / "python"))
    with pytest.raises(
        EngineError, match=r"module 'vllm' is not installed; to install it run `bash scripts/setup.sh --engine vllm`"
    ):
        check_engine("vllm")
    python = tmp_path / "python"
    python.write_text("")
    monkeypatch.setenv("PDSERVE_VLLM_PYTHON", str(python))
    for call in (check_engine, lambda n: load_engine(n, _request())):
        with pytest.raises(EngineError, match=r"engine 'vllm': pdserve's router cannot drive a vLLM server yet"):
            call("vllm")


def test_a_group_takes_an_engine_by_its_declared_capabilities_only():
    """`group_engine` hands an engine to a tensor-parallel or layer-sharded group by what it
    declares (the fake engine of tests/support declares neither), never by its type."""
    from pdserve_worker.engines.base import LAYER_SHARDS, TENSOR_PARALLEL, group_engine

    class Declared:
        name, capabilities = "declared", frozenset({LAYER_SHARDS})

    engine = Declared()
    assert group_engine(engine, LAYER_SHARDS) is engine  # type: ignore[arg-type]
    with pytest.raises(EngineError, match=r"engine 'declared' does not run tensor_parallel.*\['layer_shards'\]"):
        group_engine(engine, TENSOR_PARALLEL)  # type: ignore[arg-type]
    fake = engine_type("support.fake_engine:FakeEngine")
    assert fake.capabilities == frozenset()
