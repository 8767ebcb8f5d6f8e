"""A child that outlives its stop timeout is killed with its threads' stacks in its log
(util/stack_dump.py): `pdserve local` then says where it waited, instead of a bare timeout."""

from __future__ import annotations

import io
import sys
import textwrap
import time
from pathlib import Path

from pdserve_worker.cli.local_children import Child
from pdserve_worker.cli.local_deployment import LocalDeployment
from pdserve_worker.cli.local_plan import LocalPlan
from support.local_run import cli_env

# Ignores SIGTERM and waits in a function whose name the stacks must show.
STUCK = textwrap.dedent(
    """
    import signal, sys, time
    from pdserve_worker.util import stack_dump
    stack_dump.install()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    def waiting_for_a_peer_that_never_answers():
        print("ready", flush=True)
        while True:
            time.sleep(0.05)
    waiting_for_a_peer_that_never_answers()
    """
)


def _start(tmp_path: Path, code: str, name: str = "decode-0") -> Child:
    child = Child(name, "decode", [sys.executable, "-c", code], cli_env(), tmp_path / f"{name}.log")
    child.start()
    deadline = time.monotonic() + 30
    while "ready" not in child.tail() and time.monotonic() < deadline:
        assert child.exited() is None, child.tail()
        time.sleep(0.05)
    return child


def test_a_child_that_ignores_sigterm_is_killed_with_its_stacks_in_its_log(tmp_path):
    child = _start(tmp_path, STUCK)
    started = time.monotonic()
    assert child.stop(0.5) is True
    assert time.monotonic() - started < 10
    assert child.exited() == -9  # SIGKILL, after the stacks
    log = child.log_path.read_text()
    assert "most recent call first" in log
    assert "waiting_for_a_peer_that_never_answers" in log


def test_a_child_that_stops_is_not_killed_and_dumps_nothing(tmp_path):
    child = _start(tmp_path, STUCK.replace("signal.SIG_IGN", "lambda *a: sys.exit(0)"))
    assert child.stop(10) is False
    assert child.exited() == 0
    assert "most recent call first" not in child.log_path.read_text()


def test_the_deployment_names_the_killed_child_and_shows_where_it_waited(tmp_path):
    progress = io.StringIO()
    deployment = LocalDeployment(LocalPlan(log_dir=str(tmp_path)), progress=progress)
    deployment.children.append(_start(tmp_path, STUCK))
    deployment.stop(timeout_s=0.5)
    said = progress.getvalue()
    assert "decode-0 (pid" in said and "did not stop within 0.5s: killed" in said
    assert "waiting_for_a_peer_that_never_answers" in said
