"""`pdserve operator` without its peering object says what it waits for, or runs standalone
when it is known to be the only replica.

kopf with mandatory peering stays paused, silently, while the peering CRD or object is absent
(nolar/kopf `orchestration.adjust_tasks`, `spawn_missing_peerings`, `peering.touch`); a user saw
nothing after "Initial authentication has finished" for minutes. Each test runs the real operator
against its own API emulator (so no other test's peering CRDs are there), captures the operator's
log and checks: the message names the missing object and the command that creates it; nothing is
reconciled meanwhile; after the user runs that fix the operator resumes by itself.
"""

from __future__ import annotations

import logging
import shlex
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from test_operator import SAMPLE, all_children

from conftest import ROOT, Cluster, OperatorHandle, wait_for
from kube_emulator import EmulatorThread
from pdserve_operator import spec as s
from pdserve_operator.kube import RestKubeClient
from pdserve_operator.runtime import OperatorConfig

pytestmark = pytest.mark.slow


@pytest.fixture
def bare_cluster(tmp_path: Path) -> Iterator[Cluster]:
    """An API server with our CRD and nothing of kopf's."""
    with EmulatorThread() as emu:
        kubeconfig = emu.write_kubeconfig(tmp_path / "kubeconfig")
        kube = RestKubeClient.from_environment(str(kubeconfig))
        c = Cluster(emulator=emu, kubeconfig=kubeconfig, cache=tmp_path / "kubecache", kube=kube)
        c.kubectl("apply", "--validate=false", "-f", str(ROOT / "manifests" / "crd.yaml"))
        c.kubectl("wait", "--for=condition=established", f"crd/{s.PLURAL}.{s.GROUP}", "--timeout=20s")
        yield c
        kube.close()


@dataclass
class PeeringOperator(OperatorHandle):
    replicas: int | None = None

    def config(self) -> OperatorConfig:
        return (
            super()
            .config()
            .model_copy(
                update={
                    "standalone": False,
                    "peering": "pdserve",
                    "priority": 100,
                    "replicas": self.replicas,
                    "peering_report_seconds": 0.5,
                }
            )
        )


class Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")

    def with_event(self, event: str) -> list[str]:
        return [line for line in self.lines if f"event={event} " in line or line.endswith(f"event={event}")]


@pytest.fixture
def log() -> Iterator[Captured]:
    handler = Captured()
    logger = logging.getLogger("pdserve_operator")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def new_namespace(cluster: Cluster) -> str:
    name = f"t-{uuid.uuid4().hex[:8]}"
    cluster.kube.request(
        "POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
    )
    return name


def create_sample(cluster: Cluster, namespace: str, name: str) -> None:
    doc = yaml.safe_load(SAMPLE.read_text())
    doc["metadata"]["name"] = name
    cluster.kubectl("apply", "--validate=false", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(doc))


def fix_from(line: str) -> str:
    """The `fix=...` value of a key=value log line (quoted when it has spaces)."""
    for token in shlex.split(line.split(" ", 1)[1]):
        if token.startswith("fix="):
            return token.removeprefix("fix=")
    raise AssertionError(f"no fix= in {line!r}")


def run_fix(cluster: Cluster, command: str) -> None:
    """Run the command the log told the user to run, as they would (kubectl from the repo root)."""
    from conftest import kubectl_binary

    env = {
        "KUBECONFIG": str(cluster.kubeconfig),
        "KUBECACHEDIR": str(cluster.cache),
        "PATH": str(Path(kubectl_binary()).parent) + ":/usr/bin:/bin",
    }
    command = command.replace("kubectl ", "kubectl --validate=false ")
    out = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("with_crds", [False, True], ids=["no-peering-crds", "crds-but-no-object"])
def test_a_missing_peering_object_is_named_with_its_fix_and_the_operator_resumes_after_it(
    bare_cluster: Cluster, log: Captured, with_crds: bool
) -> None:
    cluster = bare_cluster
    if with_crds:
        cluster.kubectl("apply", "--validate=false", "-f", str(ROOT / "manifests" / "kopf-peering.yaml"))
    namespace = new_namespace(cluster)
    operator = PeeringOperator(cluster, namespace)
    operator.start()
    try:
        lines = wait_for(lambda: log.with_event("peering_missing"), timeout=10, what="a peering_missing log line")
        line = lines[0]
        assert line.startswith("WARNING") and f'waiting_for="KopfPeering {namespace}/pdserve"' in line, line
        if with_crds:
            assert f'missing="KopfPeering {namespace}/pdserve"' in line, line
            assert "kopf-peering.yaml" not in fix_from(line)
        else:
            assert 'missing="CRD kopfpeerings.kopf.dev"' in line, line
            assert fix_from(line).startswith("kubectl apply -f manifests/kopf-peering.yaml && "), line
        create_sample(cluster, namespace, "waiting")
        time.sleep(2.0)  # paused: kopf reconciles nothing meanwhile, and keeps saying why
        assert not cluster.get("Secret", namespace, "waiting-broker-token")
        assert len(log.with_event("peering_missing")) >= 2

        run_fix(cluster, fix_from(line))
        wait_for(lambda: all_children(cluster, namespace, "waiting"), timeout=60, what="children after the fix")
        wait_for(lambda: log.with_event("peering_found"), timeout=10, what="a peering_found log line")
    finally:
        operator.stop()


def test_the_only_replica_falls_back_to_standalone_with_a_warning(bare_cluster: Cluster, log: Captured) -> None:
    cluster = bare_cluster
    namespace = new_namespace(cluster)
    operator = PeeringOperator(cluster, namespace, replicas=1)
    operator.start()
    try:
        [line] = log.with_event("peering_missing_standalone")
        assert line.startswith("WARNING") and 'missing="CRD kopfpeerings.kopf.dev"' in line, line
        assert "standalone=True" in log.with_event("operator_start")[0]
        create_sample(cluster, namespace, "alone")
        wait_for(lambda: all_children(cluster, namespace, "alone"), timeout=30, what="children without peering")
        assert not log.with_event("peering_missing")
    finally:
        operator.stop()
