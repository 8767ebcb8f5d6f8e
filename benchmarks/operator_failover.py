"""How long a PDInferenceService goes unreconciled when the operator dies (issue #29).

The real operator (`pdserve operator`, kopf peering on) runs as processes against the API
emulator; each death is a SIGKILL, so nothing withdraws the dead replica's peering record.
Measured from the kill to the moment every child of a service created right after it exists:

- restart: the killed operator starts again with the same peering priority, as a container
  restart in the same pod does (the pod name, hence the derived priority, is unchanged);
- standby: a second replica of lower priority was running paused and takes over, which kopf
  allows once the dead leader's peering record is older than the peering lifetime
  (`PDSERVE_OPERATOR_PEERING_LIFETIME_SECONDS`; kopf's own default is 60 s).

Run: `python benchmarks/operator_failover.py [--lifetimes 60,15] [--runs 3]`. Prints progress,
then one line per (scenario, lifetime): the median and every run's seconds.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for sub in ("worker", "operator", "common", "proto", "tests"):
    sys.path.insert(0, str(ROOT / sub))

import yaml  # noqa: E402

from kube_emulator import EmulatorThread  # noqa: E402
from pdserve_operator import children as ch  # noqa: E402
from pdserve_operator.crd import build_adapter_crd, build_crd  # noqa: E402
from pdserve_operator.kube import KINDS, RestKubeClient  # noqa: E402

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


def operator(kubeconfig: Path, ns: str, priority: int, lifetime: int, log: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PDSERVE_OPERATOR_PEERING_LIFETIME_SECONDS=str(lifetime), PDSERVE_OPERATOR_RESYNC_SECONDS="5")
    env["PYTHONPATH"] = os.pathsep.join(str(ROOT / s) for s in ("worker", "operator", "common", "proto"))
    argv = [sys.executable, "-m", "pdserve_worker.cli.main", "operator", "--kubeconfig", str(kubeconfig)]
    argv += ["-n", ns, "--peering", PEERING, "--priority", str(priority), "--broker-port", "0", "--replicas", "2"]
    with open(log, "ab") as out:
        return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def create(kube: RestKubeClient, ns: str, name: str) -> None:
    meta = {"name": name, "namespace": ns}
    kube.create({"apiVersion": "pdserve.dev/v1alpha1", "kind": "PDInferenceService", "metadata": meta, "spec": {}})


def reconciled(kube: RestKubeClient, ns: str, name: str, timeout_s: float = 300.0) -> float:
    """Seconds until the service's router Deployment (the last workload applied) exists."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if kube.get(KINDS["Deployment"], ns, ch.workload_name(name, "router")) is not None:
            return time.monotonic() - started
        time.sleep(0.1)
    raise TimeoutError(f"{name} not reconciled within {timeout_s}s")


def kill(proc: subprocess.Popen[bytes]) -> None:
    os.killpg(proc.pid, signal.SIGKILL)  # this operator's own process group (start_new_session)
    proc.wait(10)


def one_run(kube: RestKubeClient, kubeconfig: Path, logs: Path, scenario: str, lifetime: int, run: int) -> float:
    tag = ns = f"{scenario}-{lifetime}-{run}"
    namespace(kube, ns)
    leader = operator(kubeconfig, ns, 100, lifetime, logs / f"{tag}-leader.log")
    others: list[subprocess.Popen[bytes]] = []
    try:
        if scenario == "standby":
            others.append(operator(kubeconfig, ns, 50, lifetime, logs / f"{tag}-standby.log"))
        create(kube, ns, "before")
        reconciled(kube, ns, "before", 120)  # the leader acts
        time.sleep(2.0)  # both replicas settled (the standby paused)
        kill(leader)
        killed = time.monotonic()
        if scenario == "restart":
            others.append(operator(kubeconfig, ns, 100, lifetime, logs / f"{tag}-restarted.log"))
        create(kube, ns, "after")
        reconciled(kube, ns, "after")
        return time.monotonic() - killed
    finally:
        for proc in (leader, *others):
            if proc.poll() is None:
                kill(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lifetimes", default="60,15", help="peering lifetimes to measure, seconds")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    lifetimes = [int(x) for x in args.lifetimes.split(",")]
    results: dict[tuple[str, int], list[float]] = {}
    with EmulatorThread() as emu, tempfile.TemporaryDirectory() as tmp:
        kubeconfig = emu.write_kubeconfig(Path(tmp) / "kubeconfig")
        kube = RestKubeClient.from_environment(str(kubeconfig))
        setup(kube)
        say(f"operator logs in {tmp}")
        for scenario in ("restart", "standby"):
            for lifetime in lifetimes:
                for run in range(args.runs):
                    seconds = one_run(kube, kubeconfig, Path(tmp), scenario, lifetime, run)
                    results.setdefault((scenario, lifetime), []).append(seconds)
                    say(f"{scenario} lifetime={lifetime}s run {run + 1}/{args.runs}: {seconds:.1f}s")
        kube.close()
    for (scenario, lifetime), secs in results.items():
        runs = " ".join(f"{s:.1f}" for s in secs)
        print(
            f"{scenario:8s} peering lifetime {lifetime:3d}s: median {statistics.median(secs):5.1f}s to reconcile again (runs: {runs})"
        )


if __name__ == "__main__":
    main()
