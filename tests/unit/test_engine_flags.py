"""`--engine` of `pdserve worker` and `pdserve local`: native by default; the worker's flag is
its WorkerSettings.engine; the local one reaches every worker through the env the launcher
builds; and `pdserve local --engine vllm` without vLLM stops before it starts anything,
naming the engine, the missing module and the set-up step.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pdserve_common import pod_env as E
from pdserve_worker.cli.local_env import RunFacts, worker_env
from pdserve_worker.cli.local_plan import LocalPlan
from pdserve_worker.cli.main import build_parser, main
from pdserve_worker.engines import registry

POD = {
    E.ROLE: "prefill",
    E.SERVICE: "prod/chat",
    E.BROKER_ADDRESS: "broker.pdserve:50051",
    E.BROKER_TOKEN: "s3cret",
    E.POD_IP: "10.1.2.3",
}


@pytest.fixture
def pod_environment(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name, value in POD.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(E.ENGINE, raising=False)
    return monkeypatch


def test_worker_engine_flag_feeds_the_settings_and_native_stays_the_default(pod_environment):
    from pdserve_worker.cli.worker import settings_from_args

    assert settings_from_args(build_parser().parse_args(["worker"])).engine == "native"
    assert settings_from_args(build_parser().parse_args(["worker", "--engine", "vllm"])).engine == "vllm"
    pod_environment.setenv(E.ENGINE, "vllm")  # what the operator renders into a vLLM pod
    assert settings_from_args(build_parser().parse_args(["worker"])).engine == "vllm"
    flagged = build_parser().parse_args(["worker", "--engine", "native"])  # the flag wins, as every flag does
    assert settings_from_args(flagged).engine == "native"


def _facts(plan: LocalPlan) -> RunFacts:
    return RunFacts(plan, "float32", 256, "/models/m", "m", "127.0.0.1:1", "tok", None)


def test_local_engine_reaches_every_worker_it_starts():
    ports = iter(range(20000, 20100))
    for engine in ("vllm", "native", "support.fake_engine:FakeEngine"):
        run = _facts(LocalPlan(engine=engine))
        for role in ("prefill", "decode", "router", "colocated"):
            env = worker_env(run, role, f"{role}-0", 8000, lambda: next(ports))
            assert env[E.ENGINE] == engine, (engine, role)


def test_local_engine_flag_defaults_to_native_with_and_without_demo(monkeypatch):
    from pdserve_worker.cli.local import _plan

    monkeypatch.delenv(E.ENGINE, raising=False)
    for argv in (["local"], ["local", "--demo"]):
        assert _plan(build_parser().parse_args(argv)).engine == "native"
    assert _plan(build_parser().parse_args(["local", "--demo", "--engine", "vllm"])).engine == "vllm"


def test_local_engine_from_env_or_env_flag_and_a_disagreement_refused(monkeypatch):
    from pdserve_worker.cli.local import _plan

    def plan(*argv: str) -> LocalPlan:
        return _plan(build_parser().parse_args(["local", *argv]))

    monkeypatch.setenv(E.ENGINE, "support.fake_engine:FakeEngine")  # inherited, as the seam test sets it
    assert plan().engine == "support.fake_engine:FakeEngine"
    assert plan("--engine", "native").engine == "native"  # the flag wins
    given = plan("--env", f"{E.ENGINE}=vllm")
    assert given.engine == "vllm" and E.ENGINE not in given.extra_env  # one engine: the one checked
    with pytest.raises(ValueError, match=f"--engine native and --env {E.ENGINE}=vllm disagree"):
        plan("--engine", "native", "--env", f"{E.ENGINE}=vllm")


@pytest.mark.parametrize("missing", ["engine module", "vllm"])
def test_local_vllm_without_vllm_fails_before_starting_anything(monkeypatch, capsys, tmp_path: Path, missing):
    """Missing either way: pdserve's vLLM engine module does not import, or it imports and its
    check_installed finds no vLLM (what the connector's engine says where vLLM is absent)."""
    if missing == "vllm":
        (tmp_path / "engine_no_vllm.py").write_text(
            "class Engine:\n"
            "    capabilities = frozenset()\n"
            "    @classmethod\n"
            "    def check_installed(cls):\n"
            "        raise ModuleNotFoundError(\"No module named 'vllm'\", name='vllm')\n"
        )
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.setitem(registry.ENGINES, "vllm", "engine_no_vllm:Engine")
    else:
        monkeypatch.setitem(sys.modules, "pdserve_worker.engines.vllm.engine", None)
    logs = tmp_path / "logs"
    code = main(["local", "--engine", "vllm", "--port", "0", "--timeout", "5", "--log-dir", str(logs)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "pdserve local: engine 'vllm': cannot import " in err
    assert "vllm" in err.split("module ", 1)[1].split(" is not installed")[0], err
    assert "is not installed; to install it run `bash scripts/setup.sh --engine vllm`" in err
    assert not logs.exists(), "no child was started (the log folder is made first)"


def test_local_unknown_engine_is_refused_by_name(capsys):
    assert main(["local", "--engine", "vlm", "--port", "0"]) == 2
    assert "engine 'vlm' is not registered; expected one of ['native', 'vllm']" in capsys.readouterr().err


@pytest.mark.parametrize(("flag", "what"), [("--decode-tp", "tensor_parallel"), ("--layer-shards", "layer_shards")])
def test_local_refuses_a_group_the_engine_does_not_run_before_starting(capsys, tmp_path: Path, flag, what):
    logs = tmp_path / "logs"
    argv = ["local", "--engine", "support.fake_engine:FakeEngine", flag, "3", "--port", "0", "--log-dir", str(logs)]
    assert main(argv) == 2
    assert f"engine 'support.fake_engine:FakeEngine' does not run {what}" in capsys.readouterr().err
    assert not logs.exists()
