"""SIGTERM drains the router: no new connections, streams in flight finish (up to the bound),
and streams past the bound are cancelled down to the backend. Real processes, 127.0.0.1."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from support.local_run import cli_env

ENV = cli_env()  # the source roots and tests/: the server is support/router_fake_server.py


def start(port: int, grace_s: float, tokens: int, delay_s: float) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "support.router_fake_server", str(port), str(grace_s), str(tokens), str(delay_s)],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 20
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"router did not start: {proc.communicate()[1][-2000:]}")
        time.sleep(0.05)


def refuses_connections(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.fixture
def router(port):
    procs = []

    def run(grace_s: float, tokens: int, delay_s: float) -> subprocess.Popen:
        procs.append(start(port, grace_s, tokens, delay_s))
        return procs[-1]

    yield run
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_sigterm_lets_a_stream_in_flight_finish_and_refuses_new_connections(router, port):
    proc = router(grace_s=20, tokens=20, delay_s=0.05)
    body = {"model": "fake-model", "prompt": "x", "max_tokens": 20, "stream": True}
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=10) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 3
        while not refuses_connections(port):
            assert time.monotonic() < deadline, "still accepting connections after SIGTERM"
            time.sleep(0.02)
        rest = [line for line in lines if line.startswith("data:")]
    assert '"text":"t0 "' in first
    assert rest[-1] == "data: [DONE]"
    assert sum('"text":"t' in line for line in [first, *rest]) == 20
    out, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err[-2000:]
    assert "cancelled=False tokens=20" in out and out.rstrip().endswith("exited")


def test_sigterm_cancels_streams_that_outlast_the_grace_period(router, port):
    proc = router(grace_s=0.5, tokens=400, delay_s=0.05)
    body = {"model": "fake-model", "prompt": "x", "max_tokens": 400, "stream": True}
    got = []
    started = time.monotonic()
    with pytest.raises(httpx.RemoteProtocolError):  # the server ended the stream before [DONE]
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=10) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    got.append(line)
                    if len(got) == 1:
                        proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=10)
    assert time.monotonic() - started < 5, "the grace period did not bound the drain"
    assert proc.returncode == 0, err[-2000:]
    assert "cancelled=True" in out, out
    assert "data: [DONE]" not in got and len(got) < 400
