"""Backend choice and the mirrored HIXL vocabulary."""

from __future__ import annotations

import sys
import types

import pytest

from pdserve_worker.transfer import hixl_api
from pdserve_worker.transfer.backends.host.engine import Hixl as HostHixl
from pdserve_worker.transfer.base import TransferError
from pdserve_worker.transfer.registry import create_engine


def test_cpu_backend_is_the_host_engine_with_the_mirrored_api() -> None:
    backend = create_engine("cpu")
    assert backend.name == "cpu" and isinstance(backend.engine, HostHixl) and backend.api is hixl_api
    assert backend.host is backend.engine and backend.blocking is backend.engine  # declared, not probed


def test_auto_falls_back_to_the_host_engine_without_hixl(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "hixl", None)  # import hixl -> ImportError
    assert create_engine("auto").name == "cpu"
    with pytest.raises(RuntimeError, match="'hixl' requested"):
        create_engine("hixl")


def test_auto_prefers_real_hixl_when_it_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("hixl")

    class Hixl:  # stands in for the pybind class: only its identity matters here
        pass

    fake.Hixl = Hixl  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "hixl", fake)
    backend = create_engine("auto")
    assert backend.name == "hixl" and isinstance(backend.engine, Hixl) and backend.api is fake
    assert backend.host is None and backend.blocking is None


def test_unknown_backend_name() -> None:
    with pytest.raises(ValueError, match="one of auto, hixl, cpu, two-sided, got .gpu."):
        create_engine("gpu")  # type: ignore[arg-type]


def test_check_names_the_status() -> None:
    backend = create_engine("cpu")
    backend.check(hixl_api.ALREADY_CONNECTED, "connect", hixl_api.ALREADY_CONNECTED)
    with pytest.raises(TransferError, match=r"connect: TIMEOUT\(103901\)") as err:
        backend.check(hixl_api.TIMEOUT, "connect")
    assert err.value.status == hixl_api.TIMEOUT


def test_status_codes_match_hixl() -> None:
    assert (hixl_api.SUCCESS, hixl_api.PARAM_INVALID, hixl_api.TIMEOUT, hixl_api.NOT_CONNECTED) == (
        0,
        103900,
        103901,
        103902,
    )
    assert (hixl_api.ALREADY_CONNECTED, hixl_api.UNSUPPORTED, hixl_api.RESOURCE_EXHAUSTED, hixl_api.FAILED) == (
        103903,
        103905,
        203900,
        503900,
    )
    assert [m.name for m in hixl_api.TransferStatus] == ["WAITING", "COMPLETED", "TIMEOUT", "FAILED"]
    assert (hixl_api.MEM_DEVICE, hixl_api.MEM_HOST, hixl_api.READ, hixl_api.WRITE) == (0, 1, 0, 1)
    assert hixl_api.status_name(203900) == "RESOURCE_EXHAUSTED(203900)"


def test_the_registry_names_each_backend_once_and_imports_only_the_one_asked_for() -> None:
    """A new backend is one module with `create()` and one registry line; a process that asks for
    the host engine never imports the others (gloo, CANN)."""
    import json
    import subprocess

    from pdserve_worker.transfer import registry

    assert registry.NAMES == ("auto", *registry.BACKENDS) and set(registry.AUTO) <= set(registry.BACKENDS)
    probe = (
        "import json, sys\n"
        "from pdserve_worker.transfer.registry import create_engine\n"
        "made = create_engine('cpu')\n"
        "print(json.dumps([made.name, sorted(m for m in sys.modules if 'transfer.backends' in m)]))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    name, loaded = json.loads(out.stdout)
    assert name == "cpu"
    assert "pdserve_worker.transfer.backends.host.engine" in loaded
    assert not any(m.endswith(("two_sided", "backends.hixl")) for m in loaded), loaded
