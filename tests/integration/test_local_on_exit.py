"""`pdserve local --on-exit ignore`: a child that dies stays down, the deployment says so once
and keeps serving with what is left (the router routes around the dead decode), and a later
stop still ends cleanly. Real processes on 127.0.0.1, tiny model; the decode is killed by PID."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from support.local_run import pid_alive

pytestmark = pytest.mark.slow

PROMPTS = ["The quick brown fox", "Paris is the capital of", "A language model predicts", "Berlin is"]


def complete(url: str, prompt: str) -> dict:
    model = httpx.get(f"{url}/v1/models", timeout=5).json()["data"][0]["id"]
    reply = httpx.post(
        f"{url}/v1/completions",
        timeout=60,
        json={"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True},
        headers={"x-pdserve-debug": "workers"},
    )
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_a_dead_decode_stays_down_and_the_rest_serves(tiny_model_dir, tmp_path, local_deployments):
    run = local_deployments(
        tmp_path / "pd-ignore",
        tiny_model_dir,
        slots=2,
        max_len=128,
        threads=1,
        on_exit="ignore",
        env={"PDSERVE_READINESS_TIMEOUT_MS": 3000},
    )
    pids = {c["pid"] for c in run.manifest["children"]}
    try:
        before = {p: complete(run.url, p)["choices"][0]["text"] for p in PROMPTS}
        victim = run.child("decode-1")["pid"]
        os.kill(victim, signal.SIGKILL)

        line = f"decode-1 (pid {victim}) exited with code -9; carrying on without it (--on-exit ignore)"
        deadline = time.monotonic() + 20
        while line not in run.stderr_path.read_text():
            assert time.monotonic() < deadline, f"no report of the dead decode:\n{run.stderr_path.read_text()}"
            time.sleep(0.2)

        for prompt in PROMPTS * 2:  # more requests than decode-0 has slots at once, one after another
            answer = complete(run.url, prompt)
            assert answer["choices"][0]["text"] == before[prompt]
            assert answer["pdserve"]["decode"] == "decode-0"
        assert run.proc.poll() is None, "pdserve local stopped although --on-exit ignore"
        assert run.stderr_path.read_text().count(line) == 1, "the dead decode was reported more than once"
        assert not pid_alive(victim)
        assert run.child("decode-1")["pid"] == victim, "the dead decode was restarted"
    finally:
        code = run.stop()
    assert code == 0, run.stderr_path.read_text()
    assert not [pid for pid in pids if pid_alive(pid)], "children outlived pdserve local"
