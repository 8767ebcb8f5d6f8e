"""Operator latency against the API emulator: bulk creation and scale-to-StatefulSet.

1. Create N PDInferenceServices at once; measure, per resource, the time from its create call
   to all ten children existing, and the time until all N are complete.
2. Scale each resource's decode group count (the scale subresource, as `kubectl scale` does)
   one at a time; measure the time until its StatefulSet carries the new replica count.

Baseline measured in the same run: the round trip of one GET to the emulator (the floor of any
reaction). Prints p50/p99 and ratios to that floor. Run:
    PYTHONPATH=worker:operator:common:proto:tests python benchmarks/operator_reconcile.py [--services 50]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for sub in ("worker", "operator", "common", "proto", "tests"):
    sys.path.insert(0, str(ROOT / sub))

from kube_emulator import EmulatorThread  # noqa: E402
from pdserve_operator import runner  # noqa: E402
from pdserve_operator.crd import build_crd  # noqa: E402
from pdserve_operator.kube import KINDS, PDIS, RestKubeClient  # noqa: E402
from pdserve_operator.reconcile.children.meta import (  # noqa: E402
    LABEL_MANAGED_BY,
    MANAGED_BY,
    config_name,
    headless_name,
    router_service_name,
    secret_name,
)
from pdserve_operator.runtime import OperatorConfig  # noqa: E402

CHILD_KINDS = [
    ("Secret", secret_name),
    ("ConfigMap", config_name),
    ("Service", headless_name),
    ("Service", router_service_name),
    ("Deployment", lambda n: f"{n}-prefill"),
    ("StatefulSet", lambda n: f"{n}-decode"),
    ("Deployment", lambda n: f"{n}-router"),
    ("PodDisruptionBudget", lambda n: f"{n}-prefill"),
    ("PodDisruptionBudget", lambda n: f"{n}-decode"),
    ("PodDisruptionBudget", lambda n: f"{n}-router"),
]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--services", type=int, default=50)
    ap.add_argument("--scales", type=int, default=30)
    args = ap.parse_args()
    ns = "bench"
    with EmulatorThread() as emu, tempfile.TemporaryDirectory() as tmp:
        kubeconfig = emu.write_kubeconfig(Path(tmp) / "kubeconfig")
        kube = RestKubeClient.from_environment(str(kubeconfig))
        kube.request("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", build_crd())
        kube.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})

        floor = []
        for _ in range(50):
            t0 = time.perf_counter()
            kube.get(KINDS["ConfigMap"], ns, "absent")
            floor.append(time.perf_counter() - t0)
        get_p50 = statistics.median(floor)

        stop, ready = threading.Event(), threading.Event()
        config = OperatorConfig(
            namespaces=[ns],
            standalone=True,
            kubeconfig=str(kubeconfig),
            resync_seconds=3600,
            broker_host="127.0.0.1",
            broker_port=0,
        )  # the real broker if present, on a free port
        thread = threading.Thread(
            target=runner.run, args=(config,), kwargs={"stop_flag": stop, "ready_flag": ready}, daemon=True
        )
        thread.start()
        assert ready.wait(30)

        names = [f"s{i:03d}" for i in range(args.services)]
        created: dict[str, float] = {}
        done: dict[str, float] = {}
        t_start = time.perf_counter()
        for name in names:
            kube.create(
                {
                    "apiVersion": "pdserve.dev/v1alpha1",
                    "kind": "PDInferenceService",
                    "metadata": {"name": name, "namespace": ns},
                    "spec": {},
                }
            )
            created[name] = time.perf_counter()
        while len(done) < len(names) and time.perf_counter() - t_start < 300:
            present = {
                (o["kind"], o["metadata"]["name"])
                for kind in {k for k, _ in CHILD_KINDS}
                for o in kube.list(KINDS[kind], ns, f"{LABEL_MANAGED_BY}={MANAGED_BY}")
            }
            now = time.perf_counter()
            for name in names:
                if name not in done and all((k, fn(name)) in present for k, fn in CHILD_KINDS):
                    done[name] = now
            time.sleep(0.1)  # listing 500 objects is work for the emulator too: poll gently
        total = max(done.values()) - t_start
        per = [done[n] - created[n] for n in names if n in done]
        print(f"create: {len(done)}/{len(names)} services complete (10 children each) in {total:.2f} s")
        print(
            f"create→children per service: p50 {statistics.median(per) * 1000:.0f} ms, p99 {pct(per, 0.99) * 1000:.0f} ms"
        )

        lat = []
        for i, name in enumerate(names[: args.scales]):
            want = 2 + i % 3
            t0 = time.perf_counter()
            kube.merge_patch(PDIS, ns, name, {"spec": {"replicas": want}}, "scale")
            while (kube.get(KINDS["StatefulSet"], ns, f"{name}-decode") or {}).get("spec", {}).get("replicas") != want:
                time.sleep(0.002)
            lat.append(time.perf_counter() - t0)
        p50, p99 = statistics.median(lat), pct(lat, 0.99)
        print(f"scale→StatefulSet patched ({len(lat)} requests): p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms")
        print(f"baseline GET round trip p50 {get_p50 * 1000:.1f} ms; scale p50 = {p50 / get_p50:.0f}x one GET")
        stop.set()
        thread.join(30)
        kube.close()


if __name__ == "__main__":
    main()
