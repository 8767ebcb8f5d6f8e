"""Issue 13, D4: `GET /drain` on a decode's HTTP port was unauthenticated and permanently
deregistered the decode while its liveness stayed 200. Against real processes (`pdserve
local`, tiny model): the HTTP port has no /drain, the admin port listens on 127.0.0.1 only and
wants the service's token, and a decode that was drained fails liveness (it is replaced)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from support.deployments import local_deployment
from support.local_run import LocalRun, cli, cli_env

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def deployment(tiny_model_dir, tmp_path_factory):
    run = local_deployment(tmp_path_factory.mktemp("admin-drain"), tiny_model_dir, slots=2, max_len=128)
    yield run
    run.stop_cleanly()


def decodes_registered(run: LocalRun) -> int:
    return httpx.get(f"{run.url}/health", timeout=5).json()["members"]["decode"]


def listening_address(port: int) -> str:
    """The local address a TCP socket listening on `port` is bound to (from /proc/net/tcp)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if int(hex_port, 16) == port and fields[3] == "0A":  # LISTEN
                if len(address) == 8:
                    return ".".join(str(int(address[i : i + 2], 16)) for i in (6, 4, 2, 0))
                return address
    raise AssertionError(f"nothing listens on port {port}")


def test_d4_drain_is_not_on_the_pod_port_and_the_admin_port_wants_the_token(deployment):
    decode = deployment.child("decode-0")
    assert decodes_registered(deployment) == 2
    # The review's attack: an anonymous GET /drain on the pod's HTTP port.
    assert httpx.get(f"http://{decode['http']}/drain", timeout=10).status_code == 404
    # The admin port: loopback only, whatever the worker's bind address, and no token, no drain.
    admin_port = int(decode["admin"].rsplit(":", 1)[1])
    assert listening_address(admin_port) == "127.0.0.1"
    for headers in (
        {},
        {"Authorization": "Bearer wrong-token"},
        {"Authorization": "Basic abc"},
        {"Authorization": f"Bearer {deployment.token}x"},
    ):
        reply = httpx.get(f"http://{decode['admin']}/drain", headers=headers, timeout=10)
        assert reply.status_code == 401, (headers, reply.text)
    time.sleep(0.3)
    assert decodes_registered(deployment) == 2  # nothing was drained
    assert httpx.get(f"http://{decode['http']}/readyz", timeout=5).status_code == 200


def test_d4_the_preStop_command_drains_and_the_drained_decode_fails_liveness(deployment):
    """`pdserve drain` (the pod's preStop hook) with the pod's environment: the decode leaves
    the broker, and from then on its /healthz is 503, so Kubernetes restarts it."""
    import subprocess

    decode = deployment.child("decode-1")
    env = {
        **cli_env(),
        "PDSERVE_BROKER_TOKEN": deployment.token,
        "PDSERVE_ADMIN_PORT": decode["admin"].rsplit(":", 1)[1],
    }
    out = subprocess.run(cli("drain", "--timeout", "30"), env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert '"drained": true' in out.stdout
    assert httpx.get(f"http://{decode['http']}/healthz", timeout=5).status_code == 503
    deadline = time.monotonic() + 10
    while decodes_registered(deployment) != 1:
        assert time.monotonic() < deadline, "the drained decode is still registered"
        time.sleep(0.05)
    # Without the token the command fails, and says why.
    env.pop("PDSERVE_BROKER_TOKEN")
    out = subprocess.run(cli("drain"), env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "PDSERVE_BROKER_TOKEN" in out.stderr
