"""The real operator for the soak (`soak.py --operator real`).

`pdserve operator` runs as a process against the API emulator (tests/kube_emulator), with kopf
peering on, and hosts the broker that `pdserve local --broker ... --token-file ...` attaches
its workers to, with the service token from the operator's Secret, as pods would. The soak's
fault kills it with SIGKILL (its own process group, by PID) and starts it again at once with
the same peering priority, as its container's restart would; the workers re-register with the
new broker from their own retries. Set-up (CRDs, namespace, peering object, the operator's
command line) is benchmarks/operator_failover.py's.
"""

from __future__ import annotations

import asyncio
import base64
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for sub in ("benchmarks", "tests"):
    if str(ROOT / sub) not in sys.path:
        sys.path.insert(0, str(ROOT / sub))

from kube_emulator import EmulatorThread  # noqa: E402
from operator_failover import kill, namespace, operator, setup  # noqa: E402
from pdserve_common.auth import role_token  # noqa: E402
from pdserve_operator.kube import KINDS, RestKubeClient  # noqa: E402
from pdserve_operator.reconcile.children.meta import secret_name  # noqa: E402
from pdserve_worker.cli.local_env import SERVICE  # noqa: E402
from pdserve_worker.rpc.broker_client import BrokerClient  # noqa: E402
from pdserve_worker.util.free_ports import free_port  # noqa: E402

PEERING_LIFETIME_S = 30  # as tests/e2e/test_operator_killed_under_load.py


class RealOperator:
    """The emulator, the service `pdserve local` serves (local/pdserve, 2 prefill and 2 decode),
    and the operator process; `address` and `token_file` are what `pdserve local` attaches with."""

    def __init__(self, work: Path, prefill: int, decode: int) -> None:
        self.work = work
        self.ns, self.name = SERVICE.split("/")
        self.emulator = EmulatorThread().__enter__()
        self.kubeconfig = self.emulator.write_kubeconfig(work / "kubeconfig")
        self.kube = RestKubeClient.from_environment(str(self.kubeconfig))
        setup(self.kube)
        namespace(self.kube, self.ns)
        spec = {"prefill": {"replicas": prefill}, "decode": {"replicas": decode}}
        meta = {"name": self.name, "namespace": self.ns}
        self.kube.create(
            {"apiVersion": "pdserve.dev/v1alpha1", "kind": "PDInferenceService", "metadata": meta, "spec": spec}
        )
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.pids: list[int] = []  # every operator process started, the killed ones too
        self.proc = self._start()
        try:
            self.token = self._wait_token(120.0)
        except BaseException:
            self.close()
            raise
        self.token_file = work / "broker-token"
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(self.token)

    def _start(self) -> subprocess.Popen[bytes]:
        log = self.work / f"operator-{len(self.pids)}.log"
        proc = operator(self.kubeconfig, self.ns, 100, PEERING_LIFETIME_S, log, self.port)
        self.pids.append(proc.pid)
        return proc

    def _wait_token(self, timeout_s: float) -> str:
        """The service token from the Secret the operator's reconcile writes."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the operator exited with code {self.proc.returncode}; log in {self.work}")
            secret = self.kube.get(KINDS["Secret"], self.ns, secret_name(self.name))
            if secret is not None:
                return base64.b64decode(secret["data"]["token"]).decode()
            time.sleep(0.2)
        raise TimeoutError(f"no Secret {self.ns}/{secret_name(self.name)} within {timeout_s}s; log in {self.work}")

    def kill_and_restart(self) -> int:
        """SIGKILL the operator (its process group, by PID) and start it again; returns the PID killed."""
        pid = self.proc.pid
        kill(self.proc)
        self.proc = self._start()
        return pid

    def serving(self, want: dict[str, int]) -> bool:
        """Whether the operator's broker has at least `want` workers of each role registered."""

        async def ask() -> dict[str, int]:
            client = BrokerClient(self.address, SERVICE, role_token(self.token, "router"))
            try:
                roles = [m.info.role.value for m in await client.list_members()]
                return {role: roles.count(role) for role in want}
            except Exception:
                return {}
            finally:
                await client.close()

        got = asyncio.run(ask())
        return all(got.get(role, 0) >= n for role, n in want.items())

    def close(self) -> None:
        if self.proc.poll() is None:
            kill(self.proc)
        self.kube.close()
        self.emulator.__exit__(None, None, None)
