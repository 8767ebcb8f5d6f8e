"""Two operator replicas with kopf peering (as a second replica would run by accident, or
during a node drain): only the higher-priority one acts; when it stops, the other takes over
and serves the resources created meanwhile. Both are the real operator against the emulator,
each with its own (fake) broker, so which replica reconciled a service is visible: the one that
handed the service's token to its broker."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from test_operator import SAMPLE, all_children

from conftest import ROOT, Cluster, OperatorHandle, wait_for
from pdserve_operator.runtime import OperatorConfig

pytestmark = pytest.mark.slow


@dataclass
class PeeredOperator(OperatorHandle):
    priority: int = 0

    def config(self) -> OperatorConfig:
        return (
            super()
            .config()
            .model_copy(update={"standalone": False, "peering": "pdserve-e2e", "priority": self.priority})
        )


@pytest.fixture(scope="module")
def peering_crd(cluster: Cluster) -> None:
    cluster.kubectl("apply", "--validate=false", "-f", str(ROOT / "manifests" / "kopf-peering.yaml"))
    cluster.kubectl("wait", "--for=condition=established", "crd/kopfpeerings.kopf.dev", "--timeout=20s")


def peers(cluster: Cluster, namespace: str) -> dict:
    """The peering object's status: one record per live replica (kopf's peering.py)."""
    doc = yaml.safe_load(cluster.kubectl("get", "kopfpeering", "pdserve-e2e", "-n", namespace, "-o", "yaml").stdout)
    return dict((doc or {}).get("status") or {})


def create(cluster: Cluster, namespace: str, name: str, tmp: Path) -> None:
    doc = yaml.safe_load(SAMPLE.read_text())
    doc["metadata"]["name"] = name
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    cluster.kubectl("apply", "--validate=false", "-n", namespace, "-f", str(path))


def test_only_the_leader_acts_and_the_standby_takes_over(
    cluster: Cluster, namespace: str, peering_crd: None, tmp_path: Path
) -> None:
    cluster.kubectl(
        "apply",
        "--validate=false",
        "-n",
        namespace,
        "-f",
        "-",
        stdin=yaml.safe_dump({"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": "pdserve-e2e"}}),
    )
    leader = PeeredOperator(cluster, namespace, priority=200)
    standby = PeeredOperator(cluster, namespace, priority=100)
    leader.start()
    try:
        # Start the standby only once the leader's record is in the peering object, and create
        # work only once the standby has written its own (so it has read the leader's): two
        # replicas started in the same instant may both act until each sees the other, which is
        # kopf's documented behaviour and not what this test is about.
        wait_for(lambda: len(peers(cluster, namespace)) == 1, timeout=30, what="the leader's peering record")
        standby.start()
        wait_for(lambda: len(peers(cluster, namespace)) == 2, timeout=30, what="the standby's peering record")
        time.sleep(1.0)  # the standby handles the peering event it has just caused
        create(cluster, namespace, "first", tmp_path)
        wait_for(lambda: all_children(cluster, namespace, "first"), timeout=30, what="children of 'first'")
        assert f"{namespace}/first" in leader.broker.tokens
        time.sleep(2.0)  # several resync periods: a standby that acted would have registered the token by now
        assert standby.broker.token_calls == 0, "the lower-priority replica reconciled while the leader ran"

        leader.stop()  # a clean stop withdraws its peering record at once
        create(cluster, namespace, "second", tmp_path)
        wait_for(
            lambda: all_children(cluster, namespace, "second"), timeout=60, what="children of 'second' by the standby"
        )
        assert f"{namespace}/second" in standby.broker.tokens
        assert f"{namespace}/second" not in leader.broker.tokens
    finally:
        standby.stop()
        leader.stop()  # a no-op when it stopped above
