"""spec.engine through the API emulator: the CRD admits native and vllm (native by default) and
refuses anything else and the shapes the vLLM engine does not run; the operator renders a vLLM
service's prefill and decode pods with the vLLM image for its device (or spec.vllmImage) and
PDSERVE_ENGINE=vllm, while its router keeps the worker image. The chart's values reach the
operator as the vLLM image of each device type.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from kube_emulator import EmulatorThread
from pdserve_common import pod_env as E
from pdserve_operator import spec as s
from pdserve_operator.broker.view import NullBrokerView
from pdserve_operator.crd import build_crd
from pdserve_operator.kube import KINDS, PDIS, KubeError, RestKubeClient
from pdserve_operator.reconcile.children.meta import VLLM_IMAGES, Defaults
from pdserve_operator.reconcile.reconciler import Reconciler
from pdserve_operator.runtime import OperatorConfig
from support.kube_fake import reconcile

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from chart_tools import by_kind, render  # noqa: E402

NS = "engines"
IMAGES = {"cpu": "reg/pdserve:9-vllm-cpu", "cuda": "reg/pdserve:9-vllm-cuda", "npu": "reg/pdserve:9-vllm-ascend"}
DEFAULTS = Defaults(image="reg/pdserve:9", broker_address="broker:50070", vllm_images=IMAGES)
DEVICES: dict[str, dict[str, Any]] = {
    "cpu": {"type": "cpu"},
    "cuda": {"type": "cuda", "resourceName": "nvidia.com/gpu", "count": 1},
    "npu": {"type": "npu", "resourceName": "huawei.com/Ascend910", "count": 1},
}
KUBERNETES_VERSION = "1.30.0"


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RestKubeClient]:
    with EmulatorThread() as emu:
        client = RestKubeClient.from_environment(str(emu.write_kubeconfig(tmp_path_factory.mktemp("kc") / "config")))
        client.request("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", build_crd())
        client.request(
            "POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}
        )
        yield client
        client.close()


def _create(kube: RestKubeClient, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    body = {"apiVersion": s.API_VERSION, "kind": s.KIND, "metadata": {"name": name, "namespace": NS}, "spec": spec}
    return dict(kube.request("POST", f"/apis/{s.GROUP}/{s.VERSION}/namespaces/{NS}/{s.PLURAL}", body))


def _workers(kube: RestKubeClient, name: str) -> dict[str, dict[str, Any]]:
    """Each role's workload, as the emulator stored it, after one reconcile."""
    rec = Reconciler(kube, NullBrokerView(), DEFAULTS, clock=lambda: "2026-12-07T00:00:00Z")
    reconcile(rec, NS, name)
    found = {
        "prefill": kube.get(KINDS["Deployment"], NS, f"{name}-prefill"),
        "decode": kube.get(KINDS["StatefulSet"], NS, f"{name}-decode"),
        "router": kube.get(KINDS["Deployment"], NS, f"{name}-router"),
    }
    assert all(found.values()), {role: obj is not None for role, obj in found.items()}
    return {role: obj for role, obj in found.items() if obj is not None}


def _container(workload: dict[str, Any]) -> dict[str, Any]:
    return dict(workload["spec"]["template"]["spec"]["containers"][0])


def _env(workload: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in _container(workload)["env"]}


@pytest.mark.parametrize("device", sorted(DEVICES))
def test_vllm_prefill_and_decode_run_the_vllm_image_of_their_device(kube, device):
    name = f"vllm-{device}"
    stored = _create(kube, name, {"engine": "vllm", "device": DEVICES[device]})
    assert stored["spec"]["engine"] == "vllm"
    workers = _workers(kube, name)
    for role in ("prefill", "decode"):
        container = _container(workers[role])
        assert container["image"] == IMAGES[device], role
        assert container["command"] == ["pdserve"] and container["args"] == ["worker", "--role", role]
        assert _env(workers[role])[E.ENGINE] == "vllm", role
    assert _container(workers["router"])["image"] == DEFAULTS.image  # the router loads no model
    assert E.ENGINE not in _env(workers["router"])
    for workload in workers.values():  # what a real API server would admit, field by field
        kubernetes_validate.validate(workload, KUBERNETES_VERSION, strict=True)


def test_vllm_image_overrides_the_operator_default_and_native_stays_the_default(kube):
    _create(kube, "own-image", {"engine": "vllm", "vllmImage": "mine/vllm:2", "image": "mine/router:2"})
    workers = _workers(kube, "own-image")
    assert [_container(workers[r])["image"] for r in ("prefill", "decode", "router")] == [
        "mine/vllm:2",
        "mine/vllm:2",
        "mine/router:2",
    ]
    stored = _create(kube, "plain", {})
    assert stored["spec"]["engine"] == "native"  # the CRD's default, applied by the API server
    workers = _workers(kube, "plain")
    for role in ("prefill", "decode"):
        assert _container(workers[role])["image"] == DEFAULTS.image
        assert _env(workers[role])[E.ENGINE] == "native"


@pytest.mark.parametrize(
    ("spec", "said"),
    [
        ({"engine": "tgi"}, 'spec.engine: Unsupported value: "tgi": supported values: "native", "vllm"'),
        ({"vllmImage": "mine/vllm:2"}, "vllmImage is only used with engine vllm"),
        ({"engine": "vllm", "decode": {"layerShards": 2}}, "engine vllm: layer-sharded and tensor-parallel groups"),
        (
            {"engine": "vllm", "prefill": {"tensorParallelSize": 3}},
            "engine vllm: layer-sharded and tensor-parallel groups",
        ),
    ],
    ids=["unknown-engine", "image-without-vllm", "vllm-layer-shards", "vllm-tensor-parallel"],
)
def test_the_crd_refuses_what_the_engines_do_not_run(kube, spec, said):
    with pytest.raises(KubeError) as caught:
        _create(kube, "refused", spec)
    assert caught.value.status == 422 and said in caught.value.message, caught.value.message
    assert kube.get(PDIS, NS, "refused") is None
    with pytest.raises(s.ValidationError, match=r"engine|vllmImage"):  # and the operator's own check agrees
        s.parse_spec(spec)


def test_chart_values_reach_the_operator_as_the_vllm_image_of_each_device(monkeypatch):
    def operator_env(*values: str) -> dict[str, str]:
        deployment = by_kind(render(*values), "Deployment")[0]
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        return {e["name"]: e["value"] for e in container["env"] if "value" in e}

    env = operator_env()
    assert {d: env[f"PDSERVE_OPERATOR_VLLM_IMAGE_{d.upper()}"] for d in DEVICES} == VLLM_IMAGES
    env = operator_env("--set-string", "workerImage.tag=7", "--set", "workerImage.vllm.npu=reg.io:5000/asc:1")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = OperatorConfig()
    assert (config.vllm_image_cpu, config.vllm_image_cuda, config.vllm_image_npu) == (
        "pdserve:7-vllm-cpu",
        "pdserve:7-vllm-cuda",
        "reg.io:5000/asc:1",
    )


@pytest.mark.parametrize(
    ("value", "said"),
    [("workerImage.vllm.tpu=x:1", "tpu"), ("workerImage.vllm.cpu=x:latest", "workerImage.vllm.cpu")],
)
def test_chart_schema_refuses_an_unknown_device_or_a_latest_vllm_image(value, said):
    import subprocess

    import chart_tools

    out = subprocess.run(
        [chart_tools.helm(), "lint", "--strict", str(chart_tools.CHART), "--set", value],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0 and said in out.stdout + out.stderr, out.stdout + out.stderr
