"""The operator killed under load (issue #29 item 5): real workers serving, the operator process
SIGKILLed mid-stream and started again, as its container would be.

The operator runs as a process against the API emulator and hosts the broker; the workers are
`pdserve local`'s (tiny model), attached to that broker (`--broker`, `--token-file`) with the
service's token from its Secret, as pods would be. Requests in flight must all complete with their undisturbed answers (the data
plane never goes through the operator), and the restarted operator's broker must take the
workers' re-registrations well before kopf peering lets it reconcile (peering lifetime 30 s
here): a broker that waited for the reconcile, as before broker/tokens.py, took them only then.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import ROOT, Cluster, wait_for
from pdserve_common.auth import role_token
from pdserve_operator import spec as s
from pdserve_operator.kube import KINDS
from pdserve_worker.cli.local_deployment import LocalDeployment
from pdserve_worker.cli.local_env import SERVICE
from pdserve_worker.cli.local_plan import LocalPlan
from pdserve_worker.rpc.broker_client import BrokerClient
from pdserve_worker.util.free_ports import free_port
from support.local_run import Answer, served_model, stream_completion
from support.tiny_model import write_tiny_model

pytestmark = pytest.mark.slow

NAMESPACE, NAME = SERVICE.split("/")  # the service `pdserve local`'s workers belong to
PEERING = "pdserve-e2e-kill"
PROMPTS = ["The quick brown fox", "Paris is the capital of", "A language model predicts"]
MAX_TOKENS = 120


def start_operator(kubeconfig: Path, broker_port: int, log: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PDSERVE_OPERATOR_PEERING_LIFETIME_SECONDS="30", PDSERVE_OPERATOR_RESYNC_SECONDS="5")
    env["PYTHONPATH"] = os.pathsep.join(str(ROOT / s) for s in ("worker", "operator", "common", "proto"))
    argv = [sys.executable, "-m", "pdserve_worker.cli.main", "operator", "--kubeconfig", str(kubeconfig)]
    argv += ["-n", NAMESPACE, "--peering", PEERING, "--priority", "100", "--replicas", "1"]
    argv += ["--broker-port", str(broker_port), "--broker-address", f"127.0.0.1:{broker_port}"]
    with open(log, "ab") as out:
        return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def registered(address: str, token: str) -> set[str]:
    """The roles registered with the broker at `address` now (a router's view)."""

    async def ask() -> set[str]:
        client = BrokerClient(address, SERVICE, role_token(token, "router"))
        try:
            return {m.info.role.value for m in await client.list_members()}
        except Exception:
            return set()
        finally:
            await client.close()

    return asyncio.run(ask())


@pytest.fixture
def served(cluster: Cluster, tmp_path: Path) -> Iterator[tuple[LocalDeployment, dict, str]]:
    cluster.kubectl("apply", "--validate=false", "-f", str(ROOT / "manifests" / "kopf-peering.yaml"))
    cluster.kube.request(
        "POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}
    )
    peering = {
        "apiVersion": "kopf.dev/v1",
        "kind": "KopfPeering",
        "metadata": {"name": PEERING, "namespace": NAMESPACE},
    }
    cluster.kube.request("POST", f"/apis/kopf.dev/v1/namespaces/{NAMESPACE}/kopfpeerings", peering)
    cluster.kube.create(
        {"apiVersion": s.API_VERSION, "kind": s.KIND, "metadata": {"name": NAME, "namespace": NAMESPACE}}
    )
    port = free_port()
    state = {"operator": start_operator(cluster.kubeconfig, port, tmp_path / "operator.log"), "port": port}
    state["kubeconfig"] = cluster.kubeconfig
    secret = wait_for(lambda: cluster.kube.get(KINDS["Secret"], NAMESPACE, f"{NAME}-broker-token"), 60, "the Secret")
    token = base64.b64decode(secret["data"]["token"]).decode()
    model = write_tiny_model(tmp_path / "model", num_layers=16)  # streams long enough to be met mid-way
    token_file = tmp_path / "broker-token"  # the workers' credentials: the operator's Secret, as a pod's
    token_file.write_text(token)
    plan = LocalPlan(
        prefill=1,
        decode=1,
        model=str(model),
        dtype="float32",
        port=0,
        slots=4,
        max_len=256,
        layers_per_chunk=1,
        threads=1,
        log_dir=tmp_path / "local",
        broker=f"127.0.0.1:{port}",  # `pdserve local --broker --token-file`: no broker of its own
        token_file=token_file,
    )
    deployment = LocalDeployment(plan, progress=None)
    try:
        deployment.start(180)
        yield deployment, state, token
    finally:
        deployment.stop()
        for key in ("operator", "restarted"):
            proc = state.get(key)
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        for name in (NAME, "probe"):
            cluster.kube.request("DELETE", f"/apis/{s.API_VERSION}/namespaces/{NAMESPACE}/{s.PLURAL}/{name}")


def stream(url: str, prompt: str, answer: Answer) -> Answer:
    body = {"model": served_model(url), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    body.update(ignore_eos=True, stream=True)
    return stream_completion(url, body, answer)


def test_requests_in_flight_complete_and_the_restarted_broker_takes_the_workers_back(served, cluster, tmp_path):
    deployment, state, token = served
    url, address = deployment.url, f"127.0.0.1:{state['port']}"
    reference = {p: stream(url, p, Answer()).text for p in PROMPTS}
    assert registered(address, token) == {"prefill", "decode", "router"}

    killed: list[float] = []

    def kill_and_restart(chunks: int) -> None:
        if chunks == 3 and not killed:
            os.killpg(state["operator"].pid, signal.SIGKILL)  # its own process group (start_new_session)
            state["operator"].wait(10)
            killed.append(time.monotonic())
            state["restarted"] = start_operator(state["kubeconfig"], state["port"], tmp_path / "operator2.log")

    answers = [Answer() for _ in PROMPTS]
    answers[0].on_chunk = kill_and_restart
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        for future in [pool.submit(stream, url, p, a) for p, a in zip(PROMPTS, answers)]:
            future.result(timeout=120)
    assert killed, "the operator was never killed: the first stream ended too soon"
    for prompt, answer in zip(PROMPTS, answers):
        assert answer.error is None, f"{prompt!r}: {answer.error}"
        assert answer.text == reference[prompt], f"{prompt!r} differs from the undisturbed answer"

    # When did the new broker have the workers back, and when did the new operator reconcile
    # again (a service created right after the kill gets its children)?
    cluster.kube.create(
        {"apiVersion": s.API_VERSION, "kind": s.KIND, "metadata": {"name": "probe", "namespace": NAMESPACE}}
    )
    back = reconciled = None
    while (back is None or reconciled is None) and time.monotonic() - killed[0] < 90:
        now = time.monotonic() - killed[0]
        if back is None and registered(address, token) >= {"prefill", "decode"}:
            back = now
        if reconciled is None and cluster.kube.get(KINDS["Deployment"], NAMESPACE, "probe-router") is not None:
            reconciled = now
        time.sleep(0.2)
    assert back is not None and reconciled is not None, (back, reconciled)
    # The broker took them back from its Secrets, long before kopf peering let the operator act.
    assert back + 5 < reconciled, f"workers back {back:.1f} s after the kill, reconcile at {reconciled:.1f} s"
    assert stream(url, PROMPTS[1], Answer()).text == reference[PROMPTS[1]]  # and new requests are served
