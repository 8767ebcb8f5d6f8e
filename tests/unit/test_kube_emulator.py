"""The API emulator keeps the API server's promises that kopf and kubectl rely on."""

from __future__ import annotations

import json
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from kube_emulator import EmulatorThread  # noqa: E402
from pdserve_operator.crd import build_crd  # noqa: E402
from pdserve_operator.kube import KINDS, PDIS, KubeError, RestKubeClient  # noqa: E402

CM = KINDS["ConfigMap"]
DEP = KINDS["Deployment"]


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RestKubeClient]:
    with EmulatorThread() as emu:
        client = RestKubeClient.from_environment(str(emu.write_kubeconfig(tmp_path_factory.mktemp("kc") / "config")))
        client.url = emu.url  # type: ignore[attr-defined]
        client.request("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", build_crd())
        yield client
        client.close()


def cm(name: str, **labels: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": "default", "labels": labels},
        "data": {"k": "v"},
    }


def test_identity_conflicts_and_no_op_writes(kube: RestKubeClient) -> None:
    made = kube.create(cm("a"))
    meta = made["metadata"]
    assert meta["uid"] and meta["resourceVersion"] and meta["generation"] == 1
    with pytest.raises(KubeError) as err:
        kube.create(cm("a"))
    assert err.value.status == 409 and err.value.reason == "AlreadyExists"
    same = kube.merge_patch(CM, "default", "a", {"data": {"k": "v"}})
    assert same["metadata"]["resourceVersion"] == meta["resourceVersion"]  # no-op: no new version
    with pytest.raises(KubeError) as err:
        kube.merge_patch(CM, "default", "a", {"metadata": {"resourceVersion": "1"}, "data": {"k": "w"}})
    assert err.value.status == 409
    with pytest.raises(KubeError) as err:
        kube.request(
            "PATCH",
            CM.path("default", "a"),
            [{"op": "test", "path": "/metadata/resourceVersion", "value": "0"}],
            content_type="application/json-patch+json",
        )
    assert err.value.status == 422


def test_label_selectors_and_namespaces(kube: RestKubeClient) -> None:
    kube.create(cm("sel-1", app="x", tier="a"))
    kube.create(cm("sel-2", app="x", tier="b"))
    kube.create(cm("sel-3", app="y"))
    names = lambda sel: sorted(o["metadata"]["name"] for o in kube.list(CM, "default", sel))  # noqa: E731
    assert names("app=x") == ["sel-1", "sel-2"]
    assert names("app=x,tier!=a") == ["sel-2"]
    assert names("tier in (a,b),app") == ["sel-1", "sel-2"]
    assert names("!tier,app=y") == ["sel-3"]
    with pytest.raises(KubeError) as err:
        kube.create({**cm("z"), "metadata": {"name": "z", "namespace": "nowhere"}})
    assert err.value.status == 404 and "nowhere" in err.value.message


def test_status_and_scale_subresources_and_generation(kube: RestKubeClient) -> None:
    dep = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "d", "namespace": "default"},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"a": "b"}}, "template": {}},
        "status": {"readyReplicas": 9},
    }
    made = kube.create(dep)
    assert "status" not in made  # status is the controller's, even on create
    kube.merge_patch(DEP, "default", "d", {"status": {"readyReplicas": 1}, "spec": {"replicas": 4}}, "status")
    got = kube.get(DEP, "default", "d")
    assert got["status"]["readyReplicas"] == 1 and got["spec"]["replicas"] == 1 and got["metadata"]["generation"] == 1
    kube.merge_patch(DEP, "default", "d", {"status": {"readyReplicas": 5}, "metadata": {"labels": {"x": "y"}}})
    got = kube.get(DEP, "default", "d")
    assert got["status"]["readyReplicas"] == 1 and got["metadata"]["generation"] == 1  # labels are not spec
    scale = kube.merge_patch(DEP, "default", "d", {"spec": {"replicas": 3}}, "scale")
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 3 and scale["status"]["selector"] == "a=b"
    got = kube.get(DEP, "default", "d")
    assert got["spec"]["replicas"] == 3 and got["metadata"]["generation"] == 2


def test_update_operations_record_field_ownership(kube: RestKubeClient) -> None:
    """managedFields as the API server's field manager records Updates (managed_fields.py): the
    manager is fieldManager or the User-Agent's prefix; changed fields move to the writer, a
    /scale write is recorded on spec.replicas with subresource scale, a no-op moves nothing."""
    from kube_emulator.managed_fields import owners

    def write(patch: dict, manager: str, sub: str | None = None) -> None:
        kube.request(
            "PATCH", DEP.path("default", "own", sub), patch, "application/merge-patch+json", {"fieldManager": manager}
        )

    dep = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "own", "namespace": "default"},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"a": "b"}}, "template": {}},
    }
    kube.create(dep)
    got = kube.get(DEP, "default", "own")
    creator = got["metadata"]["managedFields"][0]["manager"]
    assert creator == "OpenAPI-Generator"  # the kubernetes client's User-Agent, up to its first "/"
    assert owners(got, ("spec", "replicas")) == [creator]
    write({"spec": {"replicas": 4}}, "horizontal-pod-autoscaler", "scale")
    got = kube.get(DEP, "default", "own")
    assert owners(got, ("spec", "replicas")) == ["horizontal-pod-autoscaler"]
    assert owners(got, ("spec", "selector", "matchLabels", "a")) == [creator]  # untouched: still the creator's
    [hpa] = [e for e in got["metadata"]["managedFields"] if e["manager"] == "horizontal-pod-autoscaler"]
    assert hpa["subresource"] == "scale" and hpa["operation"] == "Update"
    assert hpa["fieldsV1"] == {"f:spec": {"f:replicas": {}}}
    write({"spec": {"replicas": 4}, "metadata": {"labels": {"x": "y"}}}, "someone")  # replicas unchanged
    got = kube.get(DEP, "default", "own")
    assert owners(got, ("spec", "replicas")) == ["horizontal-pod-autoscaler"]
    assert owners(got, ("metadata", "labels", "x")) == ["someone"]
    write({"spec": {"replicas": 2}}, "someone")
    assert owners(kube.get(DEP, "default", "own"), ("spec", "replicas")) == ["someone"]


def test_custom_resources_are_defaulted_and_validated_with_cel(kube: RestKubeClient) -> None:
    body = {
        "apiVersion": "pdserve.dev/v1alpha1",
        "kind": "PDInferenceService",
        "metadata": {"name": "v", "namespace": "default"},
        "spec": {"decode": {"replicas": 2, "unknownField": 1}},
    }
    made = kube.create(body)
    assert made["spec"]["decode"]["slots"] == 8 and "unknownField" not in made["spec"]["decode"]  # defaulted, pruned
    for spec, field in (
        ({"device": {"type": "npu"}}, "spec.device.resourceName"),
        ({"decode": {"readiness": "later"}}, "spec.decode.readiness"),
        ({"router": {"service": {"nodePort": 30001}}}, "spec.router.service.nodePort"),
    ):
        with pytest.raises(KubeError) as err:
            kube.create({**body, "metadata": {"name": "w", "namespace": "default"}, "spec": spec})
        assert err.value.status == 422 and field in err.value.message, err.value.message
    with pytest.raises(KubeError) as err:
        kube.create({**body, "metadata": {"name": "n" * 41, "namespace": "default"}, "spec": {}})
    assert err.value.status == 422 and "at most 40" in err.value.message
    dry = kube.request(
        "POST",
        PDIS.path("default"),
        {**body, "metadata": {"name": "dry", "namespace": "default"}},
        query={"dryRun": "All"},
    )
    assert dry["metadata"]["name"] == "dry" and kube.get(PDIS, "default", "dry") is None


def test_finalizers_and_owner_garbage_collection(kube: RestKubeClient) -> None:
    owner = kube.create({**cm("owner"), "metadata": {"name": "owner", "namespace": "default", "finalizers": ["x/y"]}})
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner["metadata"]["uid"]}
    kube.create({**cm("child"), "metadata": {"name": "child", "namespace": "default", "ownerReferences": [ref]}})
    kube.delete(CM, "default", "owner")
    held = kube.get(CM, "default", "owner")
    assert held["metadata"]["deletionTimestamp"] and kube.get(CM, "default", "child") is not None
    kube.merge_patch(CM, "default", "owner", {"metadata": {"finalizers": None}})
    assert kube.get(CM, "default", "owner") is None and kube.get(CM, "default", "child") is None
    # Created after its owner went (a controller acting on a stale read): collected, as the real
    # garbage collector's attemptToDeleteItem does with all-dangling owner references; one live
    # owner keeps it.
    created = kube.create(
        {**cm("late"), "metadata": {"name": "late", "namespace": "default", "ownerReferences": [ref]}}
    )
    assert created["metadata"]["name"] == "late" and kube.get(CM, "default", "late") is None
    alive = kube.create(cm("alive"))
    both = [ref, {"apiVersion": "v1", "kind": "ConfigMap", "name": "alive", "uid": alive["metadata"]["uid"]}]
    kube.create({**cm("kept"), "metadata": {"name": "kept", "namespace": "default", "ownerReferences": both}})
    assert kube.get(CM, "default", "kept") is not None
    # The same when an update leaves only dangling references (the collector's graph builder
    # sees the references change); an update that keeps a live owner, or none, keeps the object.
    kube.merge_patch(CM, "default", "kept", {"metadata": {"labels": {"touched": "yes"}}})
    assert kube.get(CM, "default", "kept") is not None
    patched = kube.merge_patch(CM, "default", "kept", {"metadata": {"ownerReferences": [ref]}})
    assert patched["metadata"]["ownerReferences"] == [ref] and kube.get(CM, "default", "kept") is None
    kube.create(cm("free"))
    kube.merge_patch(CM, "default", "free", {"metadata": {"ownerReferences": both[1:]}})
    assert kube.get(CM, "default", "free") is not None


def test_watch_resumes_from_a_version_and_sends_initial_events(kube: RestKubeClient) -> None:
    first = kube.create(cm("w-1", watch="yes"))
    kube.create(cm("w-2", watch="yes"))
    url = kube.url + CM.path("default")  # type: ignore[attr-defined]

    def watch(query: str) -> list[dict]:
        with urllib.request.urlopen(
            f"{url}?watch=true&labelSelector=watch%3Dyes&timeoutSeconds=1&{query}", timeout=10
        ) as resp:
            return [json.loads(line) for line in resp.read().splitlines() if line.strip()]

    resumed = watch(f"resourceVersion={first['metadata']['resourceVersion']}")
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in resumed] == [("ADDED", "w-2")]
    initial = watch("sendInitialEvents=true&allowWatchBookmarks=true&resourceVersionMatch=NotOlderThan")
    assert [e["type"] for e in initial[:3]] == ["ADDED", "ADDED", "BOOKMARK"]
    assert initial[2]["object"]["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}
