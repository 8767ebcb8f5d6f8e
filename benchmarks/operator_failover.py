"""How long a PDInferenceService goes unreconciled when the operator dies (issue #29).

The real operator (`pdserve operator`, kopf peering on) runs as processes against the API
emulator; each death is a SIGKILL, so nothing withdraws the dead replica's peering record.
Measured from the kill to the moment every child of a service created right after it exists:

- restart: the killed operator starts again with the same peering priority, as a container
  restart in the same pod does (the pod name, hence the derived priority, is unchanged);
- standby: a second replica of lower priority was running paused and takes over, which kopf
  allows once the dead leader's peering record is older than the peering lifetime
  (`PDSERVE_OPERATOR_PEERING_LIFETIME_SECONDS`; kopf's own default is 60 s).
For the restart, also the time until its broker registers a worker of a service that existed
before the kill (the only replica loads the tokens from the Secrets at start:
operator/pdserve_operator/broker/tokens.py; before, only that service's reconcile gave it).

Run: `python benchmarks/operator_failover.py [--lifetimes 60,15] [--runs 3]`. Prints progress,
then one line per (scenario, lifetime): the median and every run's seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for sub in ("worker", "operator", "common", "proto", "tests"):
    sys.path.insert(0, str(ROOT / sub))

import yaml  # noqa: E402

from kube_emulator import EmulatorThread  # noqa: E402
from pdserve_operator.crd import build_adapter_crd, build_crd  # noqa: E402
from pdserve_operator.kube import KINDS, RestKubeClient  # noqa: E402
from pdserve_operator.reconcile.children.meta import secret_name, workload_name  # noqa: E402
from pdserve_worker.util.free_ports import free_port  # noqa: E402

PEERING = "failover"


def say(message: str) -> None:
    print(f"operator_failover: {message}", file=sys.stderr, flush=True)


def setup(kube: RestKubeClient) -> None:
    for crd in (
        build_crd(),
        build_adapter_crd(),
        *yaml.safe_load_all((ROOT / "manifests/kopf-peering.yaml").read_text()),
    ):
        if crd:
            kube.request("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)


def namespace(kube: RestKubeClient, ns: str) -> None:
    """A namespace and peering object per run: no dead record of an earlier run in the way."""
    kube.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    peering = {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": PEERING, "namespace": ns}}
    kube.request("POST", f"/apis/kopf.dev/v1/namespaces/{ns}/kopfpeerings", peering)


def operator(
    kubeconfig: Path, ns: str, priority: int, lifetime: int, log: Path, broker_port: int = 0
) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PDSERVE_OPERATOR_PEERING_LIFETIME_SECONDS=str(lifetime), PDSERVE_OPERATOR_RESYNC_SECONDS="5")
    env["PYTHONPATH"] = os.pathsep.join(str(ROOT / s) for s in ("worker", "operator", "common", "proto"))
    argv = [sys.executable, "-m", "pdserve_worker.cli.main", "operator", "--kubeconfig", str(kubeconfig)]
    argv += ["-n", ns, "--peering", PEERING, "--priority", str(priority), "--broker-port", str(broker_port)]
    argv += ["--replicas", "1" if broker_port else "2"]  # (1: the only replica, as the chart runs it)
    with open(log, "ab") as out:
        return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def create(kube: RestKubeClient, ns: str, name: str) -> None:
    meta = {"name": name, "namespace": ns}
    kube.create({"apiVersion": "pdserve.dev/v1alpha1", "kind": "PDInferenceService", "metadata": meta, "spec": {}})


def reconciled(kube: RestKubeClient, ns: str, name: str, timeout_s: float = 300.0) -> float:
    """Seconds until the service's router Deployment (the last workload applied) exists."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if kube.get(KINDS["Deployment"], ns, workload_name(name, "router")) is not None:
            return time.monotonic() - started
        time.sleep(0.1)
    raise TimeoutError(f"{name} not reconciled within {timeout_s}s")


def broker_serves(address: str, service: str, token: str, since: float, timeout_s: float = 120.0) -> float:
    """Seconds from `since` until the broker at `address` registers a prefill of `service`."""
    from pdserve_common.auth import role_token
    from pdserve_common.membership import MemberInfo, Role
    from pdserve_worker.rpc.broker_client import BrokerClient, BrokerError

    info = MemberInfo(worker_id="probe-prefill", role=Role.PREFILL, grpc_endpoint="127.0.0.1:1", revision="r")

    async def attempt() -> bool:
        client = BrokerClient(address, service, role_token(token, "prefill"))
        try:
            await client.register(info, timeout_s=1.0)
            return True
        except (BrokerError, TimeoutError):
            return False
        finally:
            await client.close()

    while time.monotonic() - since < timeout_s:
        if asyncio.run(attempt()):
            return time.monotonic() - since
        time.sleep(0.1)
    raise TimeoutError(f"the broker at {address} did not serve {service} within {timeout_s}s")


def service_token(kube: RestKubeClient, ns: str, name: str) -> str:
    secret = kube.get(KINDS["Secret"], ns, secret_name(name))
    assert secret is not None, f"{ns}/{name} has no token Secret"
    return base64.b64decode(secret["data"]["token"]).decode()


def kill(proc: subprocess.Popen[bytes]) -> None:
    os.killpg(proc.pid, signal.SIGKILL)  # this operator's own process group (start_new_session)
    proc.wait(10)


def one_run(kube: RestKubeClient, kubeconfig: Path, logs: Path, scenario: str, lifetime: int, run: int) -> Result:
    tag = ns = f"{scenario}-{lifetime}-{run}"
    namespace(kube, ns)
    port = free_port() if scenario == "restart" else 0  # the restarted one serves the broker where workers look
    leader = operator(kubeconfig, ns, 100, lifetime, logs / f"{tag}-leader.log", port)
    others: list[subprocess.Popen[bytes]] = []
    try:
        if scenario == "standby":
            others.append(operator(kubeconfig, ns, 50, lifetime, logs / f"{tag}-standby.log"))
        create(kube, ns, "before")
        reconciled(kube, ns, "before", 120)  # the leader acts
        token = service_token(kube, ns, "before")
        time.sleep(2.0)  # both replicas settled (the standby paused)
        kill(leader)
        killed = time.monotonic()
        served = None
        if scenario == "restart":
            others.append(operator(kubeconfig, ns, 100, lifetime, logs / f"{tag}-restarted.log", port))
            served = broker_serves(f"127.0.0.1:{port}", f"{ns}/before", token, killed)
        create(kube, ns, "after")
        reconciled(kube, ns, "after")
        return Result(time.monotonic() - killed, served)
    finally:
        for proc in (leader, *others):
            if proc.poll() is None:
                kill(proc)


@dataclass
class Result:
    reconciled_s: float  # kill → a new service's children exist
    broker_s: float | None  # kill → the restarted operator's broker registers a worker (restart only)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lifetimes", default="60,15", help="peering lifetimes to measure, seconds")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--scenarios", default="restart,standby", help="restart, standby or both")
    args = ap.parse_args()
    lifetimes = [int(x) for x in args.lifetimes.split(",")]
    results: dict[tuple[str, int], list[Result]] = {}
    with EmulatorThread() as emu, tempfile.TemporaryDirectory() as tmp:
        kubeconfig = emu.write_kubeconfig(Path(tmp) / "kubeconfig")
        kube = RestKubeClient.from_environment(str(kubeconfig))
        setup(kube)
        say(f"operator logs in {tmp}")
        for scenario in args.scenarios.split(","):
            for lifetime in lifetimes:
                for run in range(args.runs):
                    got = one_run(kube, kubeconfig, Path(tmp), scenario, lifetime, run)
                    results.setdefault((scenario, lifetime), []).append(got)
                    broker = "" if got.broker_s is None else f", broker serving after {got.broker_s:.1f}s"
                    say(f"{scenario} lifetime={lifetime}s run {run + 1}/{args.runs}: {got.reconciled_s:.1f}s{broker}")
        kube.close()
    for (scenario, lifetime), runs in results.items():
        secs = [g.reconciled_s for g in runs]
        line = (
            f"{scenario:8s} peering lifetime {lifetime:3d}s: median {statistics.median(secs):5.1f}s to reconcile again"
        )
        line += f" (runs: {' '.join(f'{s:.1f}' for s in secs)})"
        brokers = [g.broker_s for g in runs if g.broker_s is not None]
        if brokers:
            line += f"; broker serving after {statistics.median(brokers):.1f}s"
            line += f" (runs: {' '.join(f'{b:.1f}' for b in brokers)})"
        print(line)


if __name__ == "__main__":
    main()
