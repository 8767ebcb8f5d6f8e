"""kopf handlers: thin triggers into `Reconciler`; no Kubernetes logic lives here.

- create/update/resume of a PDInferenceService → reconcile it now (a failed API call retries
  after 2 s, one the API server refused as wrong, 400/403/422, after 30 s);
- any event of a child we manage (label `app.kubernetes.io/managed-by=pdserve-operator`) →
  reconcile its owner (coalesced);
- a per-resource timer → reconcile every `resync_seconds`, and whenever the autoscaler's next
  step is due (`autoscale/autoscaler.py`);
- delete → tell the broker to forget the service (a finalizer makes this reliable).

The shared objects arrive in kopf's `memo` (see `runner.py`); `kopf run -m
pdserve_operator.handlers` also works and builds them from PDSERVE_OPERATOR_* variables.
All handlers run in peering-aware kopf tasks, so a paused (non-leader) replica does nothing.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from pdserve_operator import spec as s
from pdserve_operator.kube import KubeError
from pdserve_operator.reconcile.children.meta import LABEL_INSTANCE, LABEL_MANAGED_BY, MANAGED_BY
from pdserve_operator.runtime import OperatorConfig, Runtime, build_runtime
from pdserve_operator.spec.scaling_adapter import ADAPTER_PLURAL

FINALIZER = "pdserve.dev/finalizer"
PREFIX = "pdserve.dev"
TIMER_TICK_SECONDS = 1.0  # the timer only checks whether a resync is due; Runtime decides how often
MANAGED = {LABEL_MANAGED_BY: MANAGED_BY}
# The NetworkPolicy child (optional) is not watched: that would need list/watch on every
# NetworkPolicy of the cluster even when the feature is off; the resync timer repairs it.
CHILD_RESOURCES = (
    ("apps", "v1", "deployments"),
    ("apps", "v1", "statefulsets"),
    ("", "v1", "services"),
    ("", "v1", "configmaps"),
    ("", "v1", "secrets"),
    ("policy", "v1", "poddisruptionbudgets"),
    (s.GROUP, s.VERSION, ADAPTER_PLURAL),  # a scaled adapter moves the spec now, not at the next resync
)
LWS_RESOURCE = ("leaderworkerset.x-k8s.io", "v1", "leaderworkersets")  # (register: only when asked)


def configure(settings: kopf.OperatorSettings) -> None:
    """Our own finalizer and annotation prefix; no kopf state in the resource's status."""
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=PREFIX, key="last-handled-configuration"
    )
    settings.posting.level = logging.INFO
    settings.execution.max_workers = 16  # blocking API calls run in this pool
    settings.watching.server_timeout = 300


async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    configure(settings)
    if "runtime" not in memo:
        memo["runtime"] = build_runtime(OperatorConfig())
    runtime: Runtime = memo["runtime"]
    logger.info("pdserve operator ready: image=%s broker=%s", runtime.config.image, runtime.config.broker_address)


def login(memo: kopf.Memo, **_: Any) -> kopf.ConnectionInfo:
    """kopf connects with the very credentials of our own client (one source, read at startup).

    kopf's default login goes through `kubernetes.config`, which fixes $KUBECONFIG when it is
    first imported; ours reads it when the operator starts.
    """
    runtime: Runtime = memo["runtime"]
    return runtime.kube.connection_info()


async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    runtime: Runtime | None = memo.get("runtime")
    if runtime is not None and memo.get("owns_runtime", True):
        runtime.close()


def _namespaced(namespace: str | None) -> str:
    """The namespace kopf passes for our namespaced resources (None only for cluster-scoped ones)."""
    if namespace is None:
        raise kopf.PermanentError("a namespaced resource arrived without a namespace")
    return namespace


async def _reconcile(memo: kopf.Memo, namespace: str, name: str, why: str) -> None:
    runtime: Runtime = memo["runtime"]
    try:
        await runtime.reconciler.request(namespace, name, why)
    except KubeError as exc:
        if exc.status in (400, 403, 422):  # our request is wrong: retrying will not help quickly
            raise kopf.TemporaryError(f"reconcile {namespace}/{name}: {exc}", delay=30) from exc
        raise kopf.TemporaryError(f"reconcile {namespace}/{name}: {exc}", delay=2) from exc


async def reconcile_service(name: str, namespace: str | None, memo: kopf.Memo, reason: str, **_: Any) -> None:
    await _reconcile(memo, _namespaced(namespace), name, str(reason))


async def resync(name: str, namespace: str | None, memo: kopf.Memo, **_: Any) -> None:
    runtime: Runtime = memo["runtime"]
    ns = _namespaced(namespace)
    if runtime.resync_due(ns, name):
        await _reconcile(memo, ns, name, "resync")
    elif runtime.reconciler.autoscaler.due(f"{ns}/{name}"):  # the planner's interval is its own
        await _reconcile(memo, ns, name, "autoscale")


async def forget_service(name: str, namespace: str | None, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    runtime: Runtime = memo["runtime"]
    ns = _namespaced(namespace)
    runtime.broker.remove_service(f"{ns}/{name}")
    runtime.reconciler.forget(ns, name, (_.get("meta") or {}).get("uid"))
    runtime.last_sync.pop((ns, name), None)
    logger.info("service removed from the broker; children go by garbage collection")


def _owner_of(body: kopf.Body) -> str | None:
    for ref in body.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("kind") == s.KIND and ref.get("apiVersion", "").startswith(s.GROUP + "/"):
            return str(ref["name"])
    # The ownerReference was removed by hand: the instance label still names the owner.
    owner = body.get("metadata", {}).get("labels", {}).get(LABEL_INSTANCE)
    return str(owner) if owner is not None else None


async def child_changed(body: kopf.Body, namespace: str | None, memo: kopf.Memo, type: str, **_: Any) -> None:
    """A managed child changed (or was listed): reconcile its owner (coalesced by the Reconciler)."""
    owner = _owner_of(body)
    if owner:
        plural = body.get("kind", "child")
        await _reconcile(memo, _namespaced(namespace), owner, f"child {plural} {type or 'listed'}")


def register(registry: kopf.OperatorRegistry, *, watch_leader_worker_sets: bool = False) -> kopf.OperatorRegistry:
    """Put our handlers into `registry` (what `runner.run` hands kopf). LeaderWorkerSets are
    watched only when asked: the watch needs list/watch on them (the chart grants it with
    `leaderWorkerSet.enabled`), and without it their readiness shows at the next resync."""
    kopf.on.startup(registry=registry)(startup)
    kopf.on.login(registry=registry)(login)
    kopf.on.cleanup(registry=registry)(cleanup)
    for on in (kopf.on.resume, kopf.on.create, kopf.on.update):
        on(s.GROUP, s.VERSION, s.PLURAL, registry=registry)(reconcile_service)
    tick = TIMER_TICK_SECONDS
    kopf.timer(s.GROUP, s.VERSION, s.PLURAL, interval=tick, initial_delay=tick, registry=registry)(resync)
    kopf.on.delete(s.GROUP, s.VERSION, s.PLURAL, registry=registry)(forget_service)
    children = CHILD_RESOURCES + ((LWS_RESOURCE,) if watch_leader_worker_sets else ())
    for group, version, plural in children:
        watch = kopf.on.event(group, version, plural, labels=MANAGED, id=f"child-{plural}", registry=registry)
        watch(child_changed)
    return registry


# `kopf run -m pdserve_operator.handlers`: the default registry, configured from the environment.
register(kopf.get_default_registry(), watch_leader_worker_sets=OperatorConfig().watch_leader_worker_sets)
