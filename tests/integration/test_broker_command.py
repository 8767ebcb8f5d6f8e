"""`pdserve broker` as a process: it answers with its tokens and stops cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from pdserve.v1 import broker_pb2, broker_pb2_grpc
from pdserve_common.channels import aio_channel

ROOT = Path(__file__).resolve().parents[2]


def subprocess_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(ROOT / "worker"), str(ROOT / "operator"), str(ROOT / "common"), str(ROOT / "proto")]
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
    env.update(extra)
    return env


def wait_for_port(proc: subprocess.Popen, timeout_s: float = 30.0) -> tuple[int, list[str]]:
    """Read the broker's log until it says where it listens."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    assert proc.stderr is not None
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        found = re.search(r"event=broker\.listening .*\bport=(\d+)", line)
        if found:
            return int(found.group(1)), lines
    proc.kill()
    raise AssertionError("broker never reported listening:\n" + "".join(lines))


async def list_members(port: int, token: str, service: str) -> list[str]:
    async with aio_channel(f"127.0.0.1:{port}", token) as channel:
        reply = await broker_pb2_grpc.BrokerStub(channel).ListMembers(
            broker_pb2.ListMembersRequest(service_key=service), timeout=5
        )
    return [m.info.worker_id for m in reply.members]


@pytest.mark.slow
def test_broker_command_serves_its_tokens_and_stops_on_sigterm(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text("ns/a: tok-a\n")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdserve_worker.cli.main",
            "broker",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--tokens-file",
            str(tokens),
            "--grace",
            "0.5",
        ],
        env=subprocess_env(PDSERVE_BROKER_TOKENS='{"ns/b": "tok-b"}'),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        port, _ = wait_for_port(proc)
        assert asyncio.run(list_members(port, "tok-a", "ns/a")) == []
        assert asyncio.run(list_members(port, "tok-b", "ns/b")) == [], "tokens from the env var must count too"
        with pytest.raises(grpc.aio.AioRpcError) as denied:
            asyncio.run(list_members(port, "tok-b", "ns/a"))
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        rest = proc.stderr.read() if proc.stderr else ""
        assert "event=broker.signal signal=SIGTERM" in rest and "event=broker.stopped" in rest, rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_broker_command_refuses_a_bad_tokens_file(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text("- just\n- a list\n")
    out = subprocess.run(
        [sys.executable, "-m", "pdserve_worker.cli.main", "broker", "--port", "0", "--tokens-file", str(tokens)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "want a mapping service_key -> token, got list" in out.stderr
