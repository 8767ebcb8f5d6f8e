"""Run `pdserve local` as a user does (a subprocess), for the serving tests.

`LocalRun.start(...)` returns once the command printed the router's URL (it does so only
when every worker is registered and ready); `stop()` sends SIGTERM, as Ctrl-C in a service
manager would, and returns the exit code. The deployment's `deployment.json` (children,
ports, PIDs) and `service-token` in the log folder give tests the broker and the workers.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve_worker.util.stack_dump import dump_stacks_then_kill

ROOT = Path(__file__).resolve().parents[2]


def cli_env() -> dict[str, str]:
    """The environment of a process a test starts: the source roots, then tests/ (so a child
    imports `support.*` as the tests do, by pyproject's pytest `pythonpath`)."""
    env = dict(os.environ)
    paths = [str(ROOT / d) for d in ("worker", "operator", "common", "proto", "tests")]
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "pdserve_worker.cli.main", *args]


@dataclass
class LocalRun:
    proc: subprocess.Popen[str]
    log_dir: Path
    url: str
    stderr_path: Path

    @classmethod
    def start(cls, log_dir: Path, *args: str, timeout_s: float = 240.0) -> LocalRun:
        log_dir.mkdir(parents=True, exist_ok=True)
        stderr_path = log_dir / "local.stderr"
        with open(stderr_path, "w") as err:
            proc = subprocess.Popen(
                cli("local", "--log-dir", str(log_dir), *args),
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=cli_env(),
            )
        deadline = time.monotonic() + timeout_s
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], 0.5)
            if ready:
                line = proc.stdout.readline().strip()
                if line.startswith(("http://", "https://")):
                    return cls(proc, log_dir, line, stderr_path)
            if proc.poll() is not None:
                break
        proc.kill()
        proc.wait()
        raise AssertionError(f"pdserve local did not come up (exit {proc.returncode}):\n{stderr_path.read_text()}")

    @property
    def manifest(self) -> dict[str, Any]:
        return json.loads((self.log_dir / "deployment.json").read_text())

    @property
    def token(self) -> str:
        return Path(self.manifest["token_file"]).read_text()

    def child(self, name: str) -> dict[str, Any]:
        return next(c for c in self.manifest["children"] if c["name"] == name)

    def drain(self, name: str, timeout_s: float = 60.0) -> Any:
        """The child's preStop drain: its admin port (127.0.0.1 only) with the service's token."""
        import httpx

        reply = httpx.get(
            f"http://{self.child(name)['admin']}/drain",
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=timeout_s,
        )
        assert reply.status_code == 200, reply.text
        return reply.json()

    def stop(self, timeout_s: float = 90.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            dump_stacks_then_kill(self.proc)  # its stacks, then its children's last lines: where it waited
            raise AssertionError(
                f"pdserve local did not stop within {timeout_s}s; its stderr's end:\n"
                f"{self.stderr_path.read_text(errors='replace')[-6000:]}\n{self._children_tails()}"
            ) from None

    def _children_tails(self, lines: int = 25) -> str:
        tails = []
        for child in self.manifest["children"]:
            text = Path(child["log"]).read_text(errors="replace").splitlines()[-lines:]
            tails.append(
                f"--- {child['name']} (pid {child['pid']}, alive: {pid_alive(child['pid'])}):\n" + "\n".join(text)
            )
        return "\n".join(tails)

    def stop_cleanly(self, also: Iterable[int] = ()) -> None:
        """Stop, and assert what every serving fixture expects of the stop: exit 0, and none of
        the deployment's children outliving it (nor the processes in `also`: children a test saw
        earlier, which a drain or a restart may have replaced since)."""
        pids = {c["pid"] for c in self.manifest["children"]} | set(also)
        code = self.stop()
        said = self.stderr_path.read_text(errors="replace")
        assert code == 0, said[-4000:]
        assert "did not stop within" not in said, said[-8000:]  # a child killed at the stop: where it hung
        assert not [pid for pid in pids if pid_alive(pid)], "children outlived pdserve local"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@dataclass
class Answer:
    """One streamed completion as a client saw it, filled in while it arrives."""

    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0
    pdserve: dict = field(default_factory=dict)
    chunks: int = 0
    error: str | None = None
    arrivals: list[float] = field(default_factory=list)  # time.monotonic() of each chunk
    on_chunk: Callable[[int], None] | None = None  # called in the reading thread after each chunk


def served_model(url: str) -> str:
    import httpx

    return httpx.get(f"{url}/v1/models", timeout=5).json()["data"][0]["id"]


def stream_completion(url: str, body: dict[str, Any], answer: Answer, timeout_s: float = 120.0) -> Answer:
    """POST a streamed /v1/completions `body` and record its SSE chunks into `answer`; an HTTP
    error or an error chunk is kept in `answer.error`, never raised."""
    import httpx

    # The debug header: the answer's `pdserve` field names the workers that served it.
    headers = {"x-pdserve-debug": "workers"}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=timeout_s) as reply:
        if reply.status_code != 200:
            answer.error = f"HTTP {reply.status_code}: {reply.read().decode()}"
            return answer
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                answer.error = str(chunk["error"])
                continue
            for choice in chunk.get("choices", []):
                answer.text += choice.get("text", "")
                answer.chunks += 1
                answer.arrivals.append(time.monotonic())
                answer.finish_reason = choice.get("finish_reason") or answer.finish_reason
                if answer.on_chunk is not None:
                    answer.on_chunk(answer.chunks)
            if chunk.get("usage"):
                answer.completion_tokens = chunk["usage"]["completion_tokens"]
            answer.pdserve = chunk.get("pdserve", answer.pdserve)
    return answer


def stop_process(pid: int, timeout_s: float = 5.0) -> None:
    """SIGSTOP `pid` and return once it is stopped: kill() only queues the signal, and a process
    running on another core goes on for a moment (a test that races it sees a 'hung' peer answer)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]  # the field after "(comm)"
        if state in ("T", "t"):
            return
        time.sleep(0.001)
    raise AssertionError(f"process {pid} not stopped {timeout_s}s after SIGSTOP (state {state})")


def requests_in_flight(run: LocalRun, name: str) -> int:
    """How many requests decode `name` is generating (its Status), 0 when it does not answer.

    A fault test checks this before it kills or freezes the decode of a stream: on a loaded
    machine the client may read chunk N after the decode already generated every token, and
    then there is nothing in flight to lose (the test then tries again, it does not pass)."""
    import grpc

    from pdserve.v1 import worker_pb2, worker_pb2_grpc

    meta = (("authorization", f"Bearer {run.token}"),)
    with grpc.insecure_channel(run.child(name)["grpc"]) as channel:
        try:
            status = worker_pb2_grpc.DecodeStub(channel).Status(worker_pb2.StatusRequest(), metadata=meta, timeout=5)
        except grpc.RpcError:
            return 0
    return int(status.active_requests)
