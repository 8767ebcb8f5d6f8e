"""spec.router.auth and spec.router.admission in the router's pods: the keys Secret is mounted
as a directory (so the kubelet's updates reach the router, which re-reads it), the worker is
told where it is, and the admission settings and replica count reach the router's environment
(read back by the worker's own settings, so the two ends cannot drift)."""

from __future__ import annotations

from pdserve_common import pod_env as E
from pdserve_operator import spec as s
from pdserve_operator.reconcile.children.meta import Defaults, Owner
from pdserve_operator.reconcile.children.pod import pod_template
from pdserve_worker.serving.settings import WorkerSettings

OWNER = Owner(name="svc", namespace="team", uid="uid-1")
DEFAULTS = Defaults(image="img:1", broker_address="b:1")


def _pod(spec: s.PDInferenceServiceSpec, role: str) -> dict:
    return pod_template(OWNER, role, spec, DEFAULTS)["spec"]


def _env(pod: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}


def test_auth_mounts_the_keys_secret_on_routers_only(monkeypatch):
    spec = s.PDInferenceServiceSpec.model_validate(
        {
            "router": {
                "replicas": 3,
                "auth": {"secretName": "team-keys"},
                "admission": {"queueSize": 500, "perTenant": 50, "deadlineSeconds": 20},
            }
        }
    )
    router = _pod(spec, "router")
    volume = next(v for v in router["volumes"] if v["name"] == "api-keys")
    assert volume["secret"]["secretName"] == "team-keys"
    assert volume["secret"]["items"] == [{"key": "keys.yaml", "path": "keys.yaml"}]
    mount = next(m for m in router["containers"][0]["volumeMounts"] if m["name"] == "api-keys")
    assert mount == {"name": "api-keys", "mountPath": E.API_KEYS_DIR, "readOnly": True}
    assert "subPath" not in mount  # a subPath mount never sees the Secret's updates
    env = _env(router)
    assert env[E.API_KEYS_FILE] == f"{E.API_KEYS_DIR}/keys.yaml"
    for name, value in env.items():
        if value is not None:
            monkeypatch.setenv(name, value)
    monkeypatch.setenv(E.BROKER_TOKEN, "t")
    settings = WorkerSettings()  # as the pod's worker reads its environment
    assert (
        settings.admission_queue,
        settings.admission_per_tenant,
        settings.admission_deadline_seconds,
        settings.router_replicas,
    ) == (500, 50, 20.0, 3)
    assert str(settings.api_keys_file) == f"{E.API_KEYS_DIR}/keys.yaml"
    for role in ("prefill", "decode"):
        pod = _pod(spec, role)
        assert all(v["name"] != "api-keys" for v in pod["volumes"])
        assert E.API_KEYS_FILE not in _env(pod) and E.ADMISSION_QUEUE not in _env(pod)


def test_without_auth_no_keys_and_default_admission():
    spec = s.PDInferenceServiceSpec()
    router = _pod(spec, "router")
    assert all(v["name"] != "api-keys" for v in router["volumes"])
    env = _env(router)
    assert E.API_KEYS_FILE not in env
    assert (
        env[E.ADMISSION_QUEUE],
        env[E.ADMISSION_PER_TENANT],
        env[E.ADMISSION_DEADLINE_SECONDS],
        env[E.ROUTER_REPLICAS],
    ) == ("1024", "256", "60", "1")
