"""Pure functions of the operator: spec → children, live → drift, children → status."""

from __future__ import annotations

import base64
import copy
import json

import pytest

from pdserve_common import pod_env
from pdserve_operator import spec as s
from pdserve_operator.reconcile import children, drift
from pdserve_operator.reconcile import status as st
from pdserve_operator.reconcile.children.env import kv_tokens_per_group
from pdserve_operator.reconcile.children.meta import Defaults, Owner, selector_string
from pdserve_operator.reconcile.children.secret import token_of
from support.worker_env import worker_settings

OWNER = Owner(name="svc", namespace="ns", uid="uid-1")
DEFAULTS = Defaults(image="img:1", broker_address="broker:50070")


def render(doc: dict | None = None, token: str = "tok") -> dict[tuple[str, str], dict]:
    objs = children.render(OWNER, s.parse_spec(doc or {}), token, DEFAULTS)
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def container(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]["containers"][0]


def env(obj: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(obj)["env"]}


def test_render_is_deterministic_and_complete() -> None:
    a, b = render(), render()
    assert a == b
    assert set(a) == {
        ("NetworkPolicy", "svc-workers"),  # on by default: real HIXL admits any peer that reaches it
        ("Secret", "svc-broker-token"),
        ("ConfigMap", "svc-config"),
        ("Service", "svc-decode-headless"),
        ("Service", "svc"),
        ("Deployment", "svc-prefill"),
        ("StatefulSet", "svc-decode"),
        ("Deployment", "svc-router"),
        ("PodDisruptionBudget", "svc-prefill"),
        ("PodDisruptionBudget", "svc-decode"),
        ("PodDisruptionBudget", "svc-router"),
    }
    for obj in a.values():
        assert obj["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
        assert obj["metadata"]["namespace"] == "ns"


def test_pod_env_round_trips_through_the_worker_contract() -> None:
    objs = render(
        {
            "decode": {"readiness": "poll", "pollIntervalMicros": 25, "layerShards": 3, "slots": 4},
            "transfer": {"engineOptions": {"a": "b"}},
        }
    )
    for (kind, name), obj in objs.items():
        if kind not in ("Deployment", "StatefulSet"):
            continue
        values = {k: v for k, v in env(obj).items() if isinstance(v, str)}
        values.update({pod_env.BROKER_TOKEN: "secret", pod_env.POD_NAME: f"{name}-4"})
        parsed = worker_settings(values)
        assert parsed.role == name.removeprefix("svc-") and parsed.service == "ns/svc"
        assert parsed.broker_address == "broker:50070" and parsed.engine_options == {"a": "b"}
        if kind == "StatefulSet":
            assert (parsed.slots, parsed.readiness_mode, parsed.poll_interval_micros) == (4, "poll", 25)
            assert parsed.group_member == (1, 1)  # ordinal 4 with 3 shards


def test_decode_statefulset_runs_groups_times_shards_pods() -> None:
    sts = render({"decode": {"replicas": 3, "layerShards": 4}})[("StatefulSet", "svc-decode")]
    assert sts["spec"]["replicas"] == 12 and sts["spec"]["serviceName"] == "svc-decode-headless"
    assert env(sts)[pod_env.LAYER_SHARDS] == "4"
    assert [pod_env.group_member(o, 4) for o in (0, 3, 4, 11)] == [(0, 0), (0, 3), (1, 0), (2, 3)]


def test_device_resources_and_user_overrides() -> None:
    objs = render(
        {
            "device": {"type": "npu", "resourceName": "huawei.com/Ascend910", "count": 2},
            "prefill": {
                "resources": {"requests": {"cpu": 4, "memory": "8Gi"}, "limits": {"huawei.com/Ascend910": 8}},
                "env": [{"name": "A", "value": "1"}, {"name": "PDSERVE_ROLE", "value": "decode"}, {"name": "EMPTY"}],
                "nodeSelector": {"pool": "npu"},
                "tolerations": [{"key": "k", "operator": "Exists", "effect": "NoSchedule"}],
            },
        }
    )
    pre = objs[("Deployment", "svc-prefill")]
    res = container(pre)["resources"]
    assert res["requests"] == {"cpu": "4", "memory": "8Gi", "huawei.com/Ascend910": "2"}
    assert res["limits"] == {"huawei.com/Ascend910": "2"}  # spec.device wins over an override
    e = env(pre)
    assert e["PDSERVE_ROLE"] == "prefill" and e["A"] == "1" and "EMPTY" in e
    assert [x for x in container(pre)["env"] if x["name"] == "EMPTY"] == [
        {"name": "EMPTY"}
    ]  # no "" the server would drop
    assert pre["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "npu"}
    assert pre["spec"]["template"]["spec"]["tolerations"] == [
        {"key": "k", "operator": "Exists", "effect": "NoSchedule"}
    ]
    assert "resources" not in container(objs[("Deployment", "svc-router")])


def test_a_tensor_parallel_prefill_pod_asks_for_a_device_per_rank_and_starts_its_ranks() -> None:
    objs = render(
        {
            "device": {"type": "npu", "resourceName": "huawei.com/Ascend910", "count": 1},
            "prefill": {"tensorParallelSize": 3},
        }
    )
    pre, dec = objs[("Deployment", "svc-prefill")], objs[("StatefulSet", "svc-decode")]
    assert container(pre)["resources"]["limits"] == {"huawei.com/Ascend910": "3"}
    assert container(dec)["resources"]["limits"] == {"huawei.com/Ascend910": "1"}
    assert env(pre)["PDSERVE_TENSOR_PARALLEL"] == "3"
    assert "PDSERVE_TENSOR_PARALLEL" not in env(dec)
    assert "PDSERVE_TENSOR_PARALLEL" not in env(render({})[("Deployment", "svc-prefill")])


def test_a_tensor_parallel_decode_pod_asks_for_a_device_per_rank_and_starts_its_ranks() -> None:
    objs = render(
        {
            "device": {"type": "cuda", "resourceName": "nvidia.com/gpu", "count": 1},
            "decode": {"tensorParallelSize": 3},
        }
    )
    pre, dec = objs[("Deployment", "svc-prefill")], objs[("StatefulSet", "svc-decode")]
    assert container(dec)["resources"]["limits"] == {"nvidia.com/gpu": "3"}
    assert container(pre)["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    assert env(dec)["PDSERVE_TENSOR_PARALLEL"] == "3" and "PDSERVE_TENSOR_PARALLEL" not in env(pre)


def test_pods_are_non_root_with_probes_and_decode_drains() -> None:
    objs = render({"decode": {"drainTimeoutSeconds": 90}})
    for kind, name in (("Deployment", "svc-prefill"), ("StatefulSet", "svc-decode"), ("Deployment", "svc-router")):
        pod = objs[(kind, name)]["spec"]["template"]["spec"]
        c = pod["containers"][0]
        assert (
            pod["securityContext"]["runAsNonRoot"] is True and c["securityContext"]["allowPrivilegeEscalation"] is False
        )
        assert (
            c["readinessProbe"]["httpGet"]["path"] == "/readyz" and c["livenessProbe"]["httpGet"]["path"] == "/healthz"
        )
        # Probes on a port of their own that no NetworkPolicy rule opens to pods (#58 A2).
        assert {p["name"]: p["containerPort"] for p in c["ports"]}["probe"] == pod_env.PROBE_PORT
        assert {c[k]["httpGet"]["port"] for k in ("readinessProbe", "livenessProbe", "startupProbe")} == {"probe"}
        assert {"name": pod_env.PROBE_PORT_ENV, "value": str(pod_env.PROBE_PORT)} in c["env"]
        assert c["args"] == ["worker", "--role", name.removeprefix("svc-")]
    decode = objs[("StatefulSet", "svc-decode")]["spec"]["template"]["spec"]
    assert decode["containers"][0]["lifecycle"]["preStop"] == {"exec": {"command": ["pdserve", "drain"]}}
    assert decode["terminationGracePeriodSeconds"] > 90


def test_pvc_model_source_mounts_the_claim() -> None:
    pre = render({"model": {"source": "pvc://weights/llama/7b"}})[("Deployment", "svc-prefill")]
    vols = {v["name"]: v for v in pre["spec"]["template"]["spec"]["volumes"]}
    assert vols["model"]["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
    assert env(pre)[pod_env.MODEL_SOURCE] == "/models/llama/7b"


def test_prefix_cache_defaults_to_auto_and_a_disk_tier_is_an_emptydir() -> None:
    pre = render()[("Deployment", "svc-prefill")]
    assert pod_env.PREFIX_CACHE_TOKENS not in env(pre)  # unset: the worker sizes it from its memory limit
    # So does a decode its pool (slots x maxLength, capped by its memory) when kvTokens is unset.
    assert pod_env.KV_TOKENS not in env(render()[("StatefulSet", "svc-decode")])
    assert (
        worker_settings(
            {**{k: v for k, v in env(pre).items() if isinstance(v, str)}, pod_env.BROKER_TOKEN: "t"}
        ).prefix_cache_tokens
        is None
    )
    assert "prefix-disk" not in {v["name"] for v in pre["spec"]["template"]["spec"]["volumes"]}
    pre = render({"prefill": {"prefixCacheTokens": 0, "prefixDiskGib": 20}})[("Deployment", "svc-prefill")]
    vols = {v["name"]: v for v in pre["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["name"]: m for m in container(pre)["volumeMounts"]}
    assert vols["prefix-disk"] == {"name": "prefix-disk", "emptyDir": {"sizeLimit": "20Gi"}}
    parsed = worker_settings({**{k: v for k, v in env(pre).items() if isinstance(v, str)}, pod_env.BROKER_TOKEN: "t"})
    assert parsed.prefix_cache_tokens == 0
    assert str(parsed.prefix_disk_dir) == mounts["prefix-disk"]["mountPath"]
    assert 0 < parsed.prefix_disk_bytes < 20 * 2**30  # under the sizeLimit the kubelet enforces
    with pytest.raises(Exception, match="prefixDiskGib|prefix_disk_gib"):
        s.parse_spec({"prefill": {"prefixDiskGib": 0}})


def test_scaling_does_not_roll_pods_but_a_setting_does() -> None:
    base = render()[("Deployment", "svc-prefill")]["spec"]["template"]
    scaled = render({"prefill": {"replicas": 5}, "decode": {"replicas": 4}})[("Deployment", "svc-prefill")]["spec"][
        "template"
    ]
    changed = render({"transfer": {"queueDepth": 2}})[("Deployment", "svc-prefill")]["spec"]["template"]
    assert base == scaled
    assert base["metadata"]["annotations"] != changed["metadata"]["annotations"]


def test_token_lives_in_the_secret_and_reads_back() -> None:
    sec = render(token="abc123")[("Secret", "svc-broker-token")]
    assert base64.b64decode(sec["data"]["token"]).decode() == "abc123"
    assert token_of(sec) == "abc123"
    assert token_of(None) is None and token_of({"data": {"token": "!!"}}) is None
    with pytest.raises(ValueError):
        children.render(OWNER, s.parse_spec({}), "", DEFAULTS)


def test_drift_ignores_server_defaults_but_sees_edits() -> None:
    desired = render()[("StatefulSet", "svc-decode")]
    live = copy.deepcopy(desired)
    live["metadata"].update(uid="u", resourceVersion="9", labels={**live["metadata"]["labels"], "extra": "x"})
    live["spec"]["revisionHistoryLimit"] = 10
    container(live)["terminationMessagePath"] = "/dev/termination-log"
    container(live)["resources"] = {}
    assert drift.content_drift(desired, live) == []

    edited = copy.deepcopy(live)
    edited["spec"]["replicas"] = 7
    container(edited)["env"][0]["value"] = "router"
    assert drift.content_drift(desired, edited) == ["spec.replicas", "spec.template.spec.containers[0].env[0].value"]
    patch = drift.merge_patch(desired)
    assert (
        patch["spec"]["replicas"] == 1
        and "status" not in patch
        and set(patch["metadata"]) == {"labels", "ownerReferences"}
    )


def test_quantities_compare_as_the_server_returns_them() -> None:
    assert drift.drifted_paths({"cpu": 2}, {"cpu": "2"}) == []
    assert drift.drifted_paths({"on": True}, {"on": "true"}) == ["on"]


def test_foreign_controller_is_detected() -> None:
    desired = render()[("Service", "svc")]
    live = copy.deepcopy(desired)
    live["metadata"]["ownerReferences"] = [
        {"uid": "other", "controller": True, "kind": "X", "name": "y", "apiVersion": "v1"}
    ]
    assert drift.foreign_controller(desired, live) == "other"
    assert drift.foreign_controller(desired, desired) is None


# ------------------------------------------------------------------ status


def workload(
    ready: int, replicas: int | None = None, gen: int = 1, observed: int = 1, conditions: list | None = None
) -> dict:
    replicas = ready if replicas is None else replicas
    return {
        "metadata": {"generation": gen},
        "status": {
            "readyReplicas": ready,
            "replicas": replicas,
            "updatedReplicas": replicas,
            "observedGeneration": observed,
            "conditions": conditions or [],
        },
    }


SPEC = s.parse_spec({"prefill": {"replicas": 2}, "decode": {"replicas": 2, "slots": 4}, "router": {"replicas": 1}})


def compute(
    observed: st.Observed,
    prev: s.PDInferenceServiceStatus | None = None,
    generation: int = 1,
    spec: s.PDInferenceServiceSpec = SPEC,
) -> s.PDInferenceServiceStatus:
    return st.compute(OWNER, spec, generation, observed, prev, "t1")


def test_phases_from_pending_to_ready() -> None:
    assert compute(st.Observed()).phase == "Pending"
    part = compute(st.Observed(prefill=workload(1, 2), decode=workload(0, 2), router=workload(1)))
    assert part.phase == "Progressing" and part.prefill.summary == "1/2"
    ready = compute(st.Observed(prefill=workload(2), decode=workload(2), router=workload(1), slots_used=3))
    assert ready.phase == "Ready" and ready.slots.summary == "3/8" and ready.decode.replicas == 2
    assert ready.condition("Ready").status == "True" and ready.condition("Progressing").status == "False"
    assert ready.decode.selector == selector_string("svc", "decode")


def test_broker_registration_gates_readiness_when_a_broker_runs() -> None:
    obs = dict(prefill=workload(2), decode=workload(2), router=workload(1))
    waiting = compute(st.Observed(**obs, registered={"prefill": 2, "decode": 1, "router": 1}))
    assert waiting.phase == "Progressing" and "decode 1/2 registered" in waiting.condition("Ready").message
    assert compute(st.Observed(**obs, registered={"prefill": 2, "decode": 2, "router": 1})).phase == "Ready"


def test_losing_pods_after_ready_is_degraded_but_scaling_is_progress() -> None:
    ready = compute(st.Observed(prefill=workload(2), decode=workload(2), router=workload(1)))
    lost = compute(st.Observed(prefill=workload(2), decode=workload(1, 2), router=workload(1)), prev=ready)
    assert lost.phase == "Degraded" and st.transition_event(ready, lost)[0] == "Warning"
    scaled = compute(
        st.Observed(prefill=workload(2), decode=workload(2, 2), router=workload(1)),
        prev=ready,
        generation=2,
        spec=s.parse_spec({"prefill": {"replicas": 2}, "decode": {"replicas": 3}, "router": {"replicas": 1}}),
    )
    assert scaled.phase == "Progressing"
    failing = compute(
        st.Observed(
            prefill=workload(0, 2, conditions=[{"type": "ReplicaFailure", "status": "True", "message": "quota"}]),
            decode=workload(2),
            router=workload(1),
        )
    )
    assert failing.phase == "Degraded" and "quota" in failing.condition("Degraded").message


def test_groups_count_only_when_every_member_is_ready() -> None:
    assert st.ready_groups([(0, True), (1, True), (2, True), (3, False), (4, True), (5, True)], 2) == 2
    spec = s.parse_spec({"decode": {"replicas": 2, "layerShards": 2}})
    out = compute(
        st.Observed(decode=workload(3, 4), decode_pods=((0, True), (1, False), (2, True), (3, True))), spec=spec
    )
    assert out.decode.ready == 1 and out.decode.replicas == 2


def test_transition_times_survive_unchanged_conditions_and_invalid_keeps_counts() -> None:
    first = compute(st.Observed())
    again = st.compute(OWNER, SPEC, 1, st.Observed(), first, "t2")
    assert again.wire() == first.wire()  # nothing changed: nothing to write
    bad = st.invalid(OWNER, 2, "spec.decode.replicas: bad", again, "t3")
    assert bad.phase == "Invalid" and bad.condition("SpecValid").message == "spec.decode.replicas: bad"
    assert bad.prefill == again.prefill and bad.observed_generation == 2
    assert st.transition_event(again, bad) == ("Warning", "InvalidSpec", "spec.decode.replicas: bad")
    assert st.previous({"phase": "Nonsense"}) is None
    assert json.loads(json.dumps(bad.wire()))["conditions"][0]["lastTransitionTime"] == "t3"


def test_broker_view_adapts_a_server_with_enum_roles_and_without_slot_tracking() -> None:
    import enum

    from pdserve_operator.broker.view import BrokerServerView, NullBrokerView

    class Role(str, enum.Enum):
        PREFILL = "prefill"
        DECODE = "decode"

    class Server:
        def __init__(self) -> None:
            self.tokens: dict[str, str] = {}

        def set_service_token(self, key: str, token: str) -> None:
            self.tokens[key] = token

        def remove_service(self, key: str) -> None:
            self.tokens.pop(key)

        def registered_counts(self, key: str) -> dict:
            return {Role.PREFILL: 2, Role.DECODE: 1}

    server = Server()
    view = BrokerServerView(server)
    view.set_service_token("ns/a", "t")
    assert server.tokens == {"ns/a": "t"}
    assert view.registered_counts("ns/a") == {"prefill": 2, "decode": 1}
    assert view.slots_in_use("ns/a") is None
    view.remove_service("ns/a")
    assert server.tokens == {}
    assert NullBrokerView().registered_counts("ns/a") is None


def test_no_tls_renders_no_tls() -> None:
    objs = render({})
    for kind, name in (("Deployment", "svc-prefill"), ("StatefulSet", "svc-decode"), ("Deployment", "svc-router")):
        pod = objs[(kind, name)]["spec"]["template"]["spec"]
        names = {e["name"] for e in pod["containers"][0]["env"]}
        assert not {n for n in names if "TLS" in n} and "tls" not in {v["name"] for v in pod["volumes"]}


def test_tls_mounts_the_secret_in_every_pod_and_the_router_serves_https(monkeypatch) -> None:
    from pdserve_common import pod_env as E
    from pdserve_worker.serving.settings import WorkerSettings

    objs = render({"tls": {"secretName": "svc-cert"}})
    for kind, name in (("Deployment", "svc-prefill"), ("StatefulSet", "svc-decode"), ("Deployment", "svc-router")):
        pod = objs[(kind, name)]["spec"]["template"]["spec"]
        container = pod["containers"][0]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["tls"]["secret"]["secretName"] == "svc-cert"
        assert {"name": "tls", "mountPath": E.TLS_DIR, "readOnly": True} in container["volumeMounts"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env[E.TLS_CERT] == f"{E.TLS_DIR}/tls.crt" and env[E.TLS_KEY] == f"{E.TLS_DIR}/tls.key"
        assert env[E.TLS_CA] == f"{E.TLS_DIR}/ca.crt"
        assert env[E.TLS_SERVER_NAME] == "svc.ns.svc" and env[E.BROKER_TLS] == "false"
        # The probes go to the plain probe port, the router's too (#58 A2: its API port can be flooded).
        assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "probe"}
        # What the operator renders is what the worker accepts (the contract of pod_env.py).
        for key, value in {**env, E.BROKER_TOKEN: "t", E.POD_NAME: "svc-decode-0"}.items():
            if value is not None:
                monkeypatch.setenv(key, value)
        settings = WorkerSettings()
        assert settings.tls is not None and settings.peer_tls.server_name == "svc.ns.svc"
        assert settings.broker_channel_tls is None  # this operator's broker is plaintext


def test_tls_server_name_can_be_given() -> None:
    objs = render({"tls": {"secretName": "svc-cert", "serverName": "workers.example.internal"}})
    env = {
        e["name"]: e.get("value")
        for e in objs[("Deployment", "svc-prefill")]["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["PDSERVE_TLS_SERVER_NAME"] == "workers.example.internal"


def test_kv_blocks_and_the_prefix_cache_reach_the_pods_and_kv_tokens_the_status() -> None:
    objs = render(
        {
            "model": {"maxLength": 1024},
            "decode": {"slots": 32, "kvBlockTokens": 32, "kvTokens": 8192},
            "prefill": {"prefixCacheTokens": 4096},
        }
    )
    decode = worker_settings(
        {k: v for k, v in env(objs[("StatefulSet", "svc-decode")]).items() if isinstance(v, str)}
        | {pod_env.BROKER_TOKEN: "x"}
    )
    assert (decode.slots, decode.kv_block_tokens, decode.kv_tokens) == (32, 32, 8192)
    prefill = worker_settings(
        {k: v for k, v in env(objs[("Deployment", "svc-prefill")]).items() if isinstance(v, str)}
        | {pod_env.BROKER_TOKEN: "x"}
    )
    assert prefill.prefix_cache_tokens == 4096
    # Unset kvTokens: the memory of the slots; status counts it per ready group.
    spec = s.parse_spec({"model": {"maxLength": 1024}, "decode": {"replicas": 2, "slots": 4}})
    assert kv_tokens_per_group(spec) == 4 * 1024
    status = compute(
        st.Observed(prefill=workload(1), decode=workload(2), router=workload(1), kv_tokens_used=1500), spec=spec
    )
    assert (status.kv_tokens.used, status.kv_tokens.total, status.kv_tokens.summary) == (1500, 8192, "1500/8192")
    unknown = compute(st.Observed(prefill=workload(1), decode=workload(2), router=workload(1)), spec=spec)
    assert unknown.kv_tokens.summary == "-/8192"
    with pytest.raises(ValueError, match="kvTokens is only meaningful"):
        s.parse_spec({"decode": {"kvBlockTokens": 0, "kvTokens": 4096}})


def test_routers_serve_the_endpoint_picker_only_when_the_spec_names_its_port() -> None:
    """#34: spec.router.endpointPickerPort starts every router's ext_proc picker (docs/gateway.md)."""
    on = render({"router": {"endpointPickerPort": 9002}})[("Deployment", "svc-router")]
    assert env(on)["PDSERVE_EPP_PORT"] == "9002"
    assert "PDSERVE_EPP_PORT" not in env(render({})[("Deployment", "svc-router")])
