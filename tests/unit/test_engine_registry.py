"""The engine registry (engines/registry.py): `vllm` is a name, and an engine that is not
installed is refused naming the engine, the missing module and the step that installs it, by
the launcher's check (no import), when the class is looked up, and when it loads.

"vLLM not installed" is made real whether or not this machine has vLLM: `None` in sys.modules
makes both `import vllm` and `find_spec("vllm")` fail, as they do where it is absent.
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


@pytest.fixture
def no_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM absent: the library blocked, pdserve's connector package forgotten so it re-imports."""
    monkeypatch.setitem(sys.modules, "vllm", None)
    for name in [m for m in sys.modules if m.startswith("pdserve_worker.engines.vllm")]:
        monkeypatch.delitem(sys.modules, name)


def _request() -> EngineLoad:
    return EngineLoad(source=None, dtype="float32", device="cpu", weights="auto", max_length=64)


def test_vllm_is_a_registered_engine_with_its_set_up_step():
    assert registry.ENGINES["vllm"] == "pdserve_worker.engines.vllm.engine:VllmEngine"
    assert registry.DEFAULT == "native"
    assert registry.SETUP["vllm"] == FIX
    check_engine("native")  # installed here: no refusal


@pytest.mark.parametrize("call", [check_engine, engine_type, lambda n: load_engine(n, _request())])
def test_vllm_without_vllm_is_refused_naming_engine_module_and_fix(no_vllm, call):
    with pytest.raises(EngineError) as caught:
        call("vllm")
    said = str(caught.value)
    assert said.startswith("engine 'vllm': cannot import pdserve_worker.engines.vllm.engine:VllmEngine")
    # The library (or, before the connector package exists, the package itself) is named.
    assert "module 'vllm' is not installed" in said or "module 'pdserve_worker.engines.vllm" in said, said
    assert f"run `{FIX}`" in said


def test_an_unregistered_engine_is_refused_by_the_check_as_by_the_lookup():
    for call in (check_engine, engine_type):
        with pytest.raises(EngineError, match=r"engine 'vlm' is not registered; expected one of \['native', 'vllm'\]"):
            call("vlm")


def _engine_module(folder: Path, name: str, body: str) -> str:
    (folder / f"{name}.py").write_text(textwrap.dedent(body))
    return f"{name}:Engine"


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
            def load(cls, request):
                import no_such_late_lib_for_pdserve_test
        """,
    )
    check_engine(at_import)  # the module itself is there: only importing it finds the gap
    with pytest.raises(EngineError) as caught:
        engine_type(at_import)
    assert "module 'no_such_lib_for_pdserve_test' is not installed" in str(caught.value)
    assert "install the package that provides 'no_such_lib_for_pdserve_test'" in str(caught.value)
    with pytest.raises(EngineError, match="module 'no_such_late_lib_for_pdserve_test' is not installed"):
        load_engine(late, _request())
    with pytest.raises(EngineError, match="module 'engine_absent_here' is not installed"):
        check_engine("engine_absent_here:Engine")
