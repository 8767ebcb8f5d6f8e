"""`pdserve complete` and `pdserve chat` as a user runs them, against a router on 127.0.0.1."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve_worker.api.app import create_app
from pdserve_worker.api.backend import NoCapacity, RequestInfo
from support.router_fakes import ScriptedBackend, running_router

ROOT = Path(__file__).resolve().parents[2]
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(
        [
            str(ROOT / "worker"),
            str(ROOT / "operator"),
            str(ROOT / "common"),
            str(ROOT / "proto"),
            os.environ.get("PYTHONPATH", ""),
        ]
    ),
}
INFO = RequestInfo(disaggregated=True, kv_bytes=5 * 1024 * 1024, kv_transfer_s=0.0031, decode="d0")


def pdserve(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdserve_worker.cli.main", *args],
        input=stdin,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )


def stats(stderr: str) -> dict[str, str]:
    line = next(ln for ln in stderr.splitlines() if "ttft_ms=" in ln)
    return dict(re.findall(r"(\w+)=(\S+)", line))


@pytest.mark.parametrize("stream", [True, False])
def test_complete_prints_the_answer_and_a_timing_line(port, stream):
    backend = ScriptedBackend(delay_s=0.05, info=INFO)
    with running_router(create_app(backend), port) as url:
        out = pdserve(
            "complete",
            "--url",
            url,
            "--prompt",
            "Say hi",
            "--max-tokens",
            "9",
            "--temperature",
            "0.5",
            *(["--stream"] if stream else []),
        )
    assert out.returncode == 0, out.stderr
    assert out.stdout == "Hello, world!\n"
    got = stats(out.stderr)
    assert got["completion_tokens"] == "4" and got["prompt_tokens"] == "6"
    assert got["kv_transferred"] == "5.00MiB" and got["kv_transfer_ms"] == "3.1" and got["disaggregated"] == "true"
    if stream:
        # The server spaces tokens 50 ms apart; only a client stall of 30+ ms could hide that.
        assert float(got["ttft_ms"]) > 0 and float(got["tpot_ms"]) >= 20.0
    else:
        assert got["ttft_ms"] == "n/a"
    params = backend.calls[0].params
    assert (params.max_tokens, params.temperature) == (9, 0.5)


def test_complete_chat_uses_the_chat_endpoint(port):
    backend = ScriptedBackend()
    with running_router(create_app(backend), port) as url:
        out = pdserve("complete", "--url", f"{url}/v1", "--chat", "--prompt", "hi there", "--stream")
    assert out.returncode == 0, out.stderr
    assert out.stdout == "Hello, world!\n"
    assert backend.chats == [[{"role": "user", "content": "hi there"}]]


def test_complete_reports_the_router_error_and_fails(port):
    with running_router(create_app(ScriptedBackend(error=NoCapacity(2, "all slots busy"))), port) as url:
        out = pdserve("complete", "--url", url, "--prompt", "x")
    assert out.returncode == 1
    assert re.search(
        r"HTTP 429: the service has no free capacity now; retry later \(request cmpl-\w+\) "
        r"\(retry after 2 s\)",
        out.stderr,
    ), out.stderr


def test_complete_names_an_unreachable_router(port):
    out = pdserve("complete", "--url", f"http://127.0.0.1:{port}", "--prompt", "x")
    assert out.returncode == 1 and f"cannot reach http://127.0.0.1:{port}" in out.stderr


def test_chat_keeps_the_conversation_across_turns(port):
    backend = ScriptedBackend(max_model_len=256)
    with running_router(create_app(backend), port) as url:
        out = pdserve(
            "chat", "--url", url, "--system", "be nice", stdin="hi\n\nand again?\n/reset\nfresh\n/exit\nnot sent\n"
        )
    assert out.returncode == 0, out.stderr
    assert out.stdout == "Hello, world!\n" * 3
    assert len([ln for ln in out.stderr.splitlines() if "ttft_ms=" in ln]) == 3
    system = {"role": "system", "content": "be nice"}
    assert backend.chats == [
        [system, {"role": "user", "content": "hi"}],
        [
            system,
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Hello, world!"},
            {"role": "user", "content": "and again?"},
        ],
        [system, {"role": "user", "content": "fresh"}],
    ]


def test_chat_goes_on_after_a_failed_turn(port):
    backend = ScriptedBackend(max_model_len=40)
    with running_router(create_app(backend), port) as url:
        out = pdserve("chat", "--url", url, "--max-tokens", "4", stdin="x" * 60 + "\nshort\n")
    assert out.returncode == 0, out.stderr
    assert "HTTP 400" in out.stderr and "maximum context length is 40" in out.stderr
    assert out.stdout == "Hello, world!\n"
    assert backend.chats[-1] == [{"role": "user", "content": "short"}]  # the failed turn was forgotten


def test_complete_sends_the_api_key_from_the_environment(port):
    from pdserve_worker.api.keys import KeyStore

    key = "sk-cli-test-0123456789abcdef"
    keys = KeyStore.parse(f'tenants:\n  - name: cli\n    keys: ["{key}"]\n')
    saved = ENV.pop("OPENAI_API_KEY", None)
    try:
        with running_router(create_app(ScriptedBackend(), keys=keys), port) as url:
            refused = pdserve("complete", "--url", url, "--prompt", "x")
            ENV["OPENAI_API_KEY"] = key
            served = pdserve("complete", "--url", url, "--prompt", "x")
    finally:
        ENV.pop("OPENAI_API_KEY", None)
        if saved is not None:
            ENV["OPENAI_API_KEY"] = saved
    assert refused.returncode == 1 and "HTTP 401: You didn't provide an API key" in refused.stderr
    assert served.returncode == 0 and served.stdout == "Hello, world!\n", served.stderr
    assert key not in served.stderr + refused.stderr
