"""The child processes of `pdserve local`: each started in a session of its own, told by the
kernel to stop if its parent dies (PR_SET_PDEATHSIG), stopped by its PID alone."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx

from pdserve_common import pod_env as E
from pdserve_worker.serving import settings as S
from pdserve_worker.util.children import die_with_parent
from pdserve_worker.util.stack_dump import dump_stacks_then_kill

HOST = "127.0.0.1"
LOG_TAIL_LINES = 30


@dataclass
class Child:
    name: str
    role: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    fds: tuple[int, ...] = ()  # the listening sockets it serves (kept by the parent: a restart gets them again)
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(
                self.argv,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                pass_fds=self.fds,
                preexec_fn=die_with_parent if sys.platform == "linux" else None,
            )
        finally:
            log.close()

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout_s: float) -> bool:
        """SIGTERM, then SIGKILL after `timeout_s`: by PID, this child only. True if it had to be
        killed; its threads' stacks are then at the end of its log (util/stack_dump.py)."""
        if self.proc is None or self.proc.poll() is not None:
            return False
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
            return False
        except subprocess.TimeoutExpired:
            dump_stacks_then_kill(self.proc)
            return True


def child_entry(child: Child) -> dict[str, object]:
    """One child as `deployment.json` lists it: who, which PID, its log and the ports it serves."""
    c = child
    return {
        "name": c.name,
        "role": c.role,
        "pid": c.pid,
        "log": str(c.log_path),
        "http": f"{HOST}:{c.env[E.HTTP_PORT_ENV]}" if E.HTTP_PORT_ENV in c.env else None,
        "grpc": f"{HOST}:{c.env[E.GRPC_PORT_ENV]}" if E.GRPC_PORT_ENV in c.env else None,
        "admin": f"{HOST}:{c.env[E.ADMIN_PORT_ENV]}" if E.ADMIN_PORT_ENV in c.env else None,
        "probe": f"{HOST}:{c.env[E.PROBE_PORT_ENV]}" if E.PROBE_PORT_ENV in c.env else None,
        "transfer": f"{HOST}:{c.env[S.TRANSFER_PORT_ENV]}" if S.TRANSFER_PORT_ENV in c.env else None,
    }


def accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def ready_members(http: httpx.Client, url: str) -> dict[str, int] | None:
    """Ready members by role from the router's /health; None while it does not answer."""
    try:
        response = http.get(f"{url}/health")
    except httpx.TransportError:
        return None
    if response.status_code != 200:
        return None
    body = response.json()
    members = body.get("members")
    return {str(k): int(v) for k, v in members.items()} if isinstance(members, dict) else None
