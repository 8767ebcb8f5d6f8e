"""A layer-sharded decode service on the API emulator: the StatefulSet's pods, resolved through
the env the operator renders, form `replicas` groups of `layerShards` members each."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import yaml

from conftest import ROOT, Cluster, OperatorHandle, wait_for
from support.worker_env import worker_settings

SAMPLE = ROOT / "manifests" / "samples" / "smollm2-cpu.yaml"


def pod_environ(sts: dict[str, Any], pod_name: str, secret: dict[str, Any] | None) -> dict[str, str]:
    """The environment the kubelet would give pod `pod_name` of this StatefulSet (the downward
    API's metadata.name, the broker token from its Secret)."""
    container = sts["spec"]["template"]["spec"]["containers"][0]
    env: dict[str, str] = {}
    for e in container["env"]:
        if "value" in e:
            env[e["name"]] = e["value"]
            continue
        source = e.get("valueFrom", {})
        field = source.get("fieldRef", {}).get("fieldPath")
        if field == "metadata.name":
            env[e["name"]] = pod_name
        elif field == "status.podIP":
            env[e["name"]] = "10.0.0.1"
        elif "secretKeyRef" in source and secret is not None:
            env[e["name"]] = base64.b64decode(secret["data"][source["secretKeyRef"]["key"]]).decode()
    return env


def test_scaled_sharded_decode_renders_groups_of_members(
    cluster: Cluster, operator: OperatorHandle, namespace: str, tmp_path: Path
) -> None:
    doc = yaml.safe_load(SAMPLE.read_text())
    doc["metadata"]["name"] = "shard"
    doc["spec"]["decode"]["layerShards"] = 2
    path = tmp_path / "shard.yaml"
    path.write_text(yaml.safe_dump(doc))
    cluster.kubectl("apply", "--validate=false", "-n", namespace, "-f", str(path))
    wait_for(lambda: cluster.get("StatefulSet", namespace, "shard-decode"), what="decode StatefulSet")

    cluster.kubectl("scale", "pdis/shard", "--replicas=3", "-n", namespace)
    sts = wait_for(
        lambda: (o := cluster.get("StatefulSet", namespace, "shard-decode")) and o["spec"]["replicas"] == 6 and o,
        what="3 groups x 2 shards = 6 decode pods",
    )
    wait_for(
        lambda: (
            ((cluster.get("PDInferenceService", namespace, "shard") or {}).get("status") or {})
            .get("decode", {})
            .get("desired")
            == 3
        ),
        what="status counts groups, not pods",
    )
    secret = cluster.get("Secret", namespace, "shard-broker-token")

    members: dict[int, list[int]] = {}
    for ordinal in range(sts["spec"]["replicas"]):
        env = worker_settings(pod_environ(sts, f"shard-decode-{ordinal}", secret))
        assert env.role == "decode" and env.layer_shards == 2
        group, member = env.group_member
        members.setdefault(group, []).append(member)
    # Consecutive ordinals fill a group: three whole groups, each member once.
    assert members == {0: [0, 1], 1: [0, 1], 2: [0, 1]}
