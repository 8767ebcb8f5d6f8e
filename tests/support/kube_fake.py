"""A recording fake of `pdserve_operator.kube.KubeClient` for the reconciler's unit tests.

Shaped like client-go's fake clientset, which Kubernetes' sample-controller tests drive
(controller_test.go): every call is recorded as an `Action` before it runs, tests inject
errors and side effects per call ("reactors"), and the objects live in a store with the
API server's semantics that a reconcile depends on.

Two parts, so the store can be swapped for the real thing:
- `Recorder` wraps any `KubeClient`: records, runs reactors, delegates. Wrapped around the real
  `RestKubeClient` on the API emulator it produces the action list the same reconcile makes in
  reality; test_reconcile_fake_matches_emulator.py asserts that the two lists are equal, so this
  fake cannot drift from the real client unnoticed.
- `MemoryKube` is the in-memory store: identity (uid, resourceVersion, generation), 409 on a
  create of an existing name, 404 on a patch of a missing one, JSON merge patches (the
  emulator's RFC 7386 implementation), the status subresource (the main endpoint ignores
  status, `/status` touches only status; generation moves with spec changes only), label
  selectors (the emulator's parser), Events kept in a list. Anything else it refuses loudly.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kube_emulator import patching, selectors
from pdserve_operator import events as ev
from pdserve_operator import spec as s
from pdserve_operator.broker.view import NullBrokerView
from pdserve_operator.kube import KINDS, Kind, KubeClient, KubeError
from pdserve_operator.reconcile.children.meta import Defaults
from pdserve_operator.reconcile.reconciler import Outcome, Reconciler
from pdserve_operator.spec.scaling_adapter import ADAPTER_KIND

Obj = dict[str, Any]
WRITES = ("create", "patch", "delete", "event")
# Kinds whose status is a subresource (the main endpoint ignores it, and a create drops it).
STATUS_SUBRESOURCE = {"Deployment", "StatefulSet", "Service", "PodDisruptionBudget", "Pod", s.KIND, ADAPTER_KIND}
CUSTOM = {s.KIND, ADAPTER_KIND}
# Kinds without a generation; the others count changes of their spec (a custom resource with a
# status subresource: of everything but metadata and status).
NO_GENERATION = {"ConfigMap", "Secret", "Event"}


@dataclass(frozen=True)
class Action:
    """One call: verb get|list|create|patch|event, what it addressed, and what it sent.

    `body` is the created object, the patch, the label selector of a list, or the Event's
    (type, reason, message).
    """

    verb: str
    kind: str
    namespace: str | None
    name: str | None
    sub: str | None = None
    body: Any = None

    @property
    def write(self) -> bool:
        return self.verb in WRITES

    def short(self) -> str:
        sub = f"/{self.sub}" if self.sub else ""
        reason = f" {self.body[1]}" if self.verb == "event" else ""
        return f"{self.verb} {self.kind}/{self.name}{sub}{reason}"


@dataclass
class Reactor:
    verb: str
    kind: str
    name: str | None
    before: Callable[[KubeClient], Any] | None
    error: KubeError | None
    times: int

    def matches(self, action: Action) -> bool:
        same = (self.verb, self.kind) == (action.verb, action.kind) and self.name in (None, action.name)
        return same and self.times != 0


@dataclass
class Recorder:
    """A `KubeClient` that records every call, runs matching reactors, then delegates to `inner`."""

    inner: KubeClient
    actions: list[Action] = field(default_factory=list)
    reactors: list[Reactor] = field(default_factory=list)

    def on(
        self,
        verb: str,
        kind: str,
        name: str | None = None,
        *,
        before: Callable[[KubeClient], Any] | None = None,
        error: KubeError | None = None,
        times: int = 1,
    ) -> None:
        """On the next `times` matching calls (-1: every one): run `before(inner)` (a change by
        someone else, not recorded), then fail with `error` instead of calling, if given."""
        self.reactors.append(Reactor(verb, kind, name, before, error, times))

    def writes(self) -> list[Action]:
        return [a for a in self.actions if a.write]

    def clear(self) -> None:
        self.actions.clear()

    def _invoke(self, action: Action, call: Callable[[], Any]) -> Any:
        self.actions.append(action)
        for reactor in self.reactors:
            if reactor.matches(action):
                reactor.times -= 1
                if reactor.before is not None:
                    reactor.before(self.inner)
                if reactor.error is not None:
                    raise reactor.error
        return call()

    def get(self, kind: Kind, namespace: str | None, name: str) -> Obj | None:
        return self._invoke(Action("get", kind.kind, namespace, name), lambda: self.inner.get(kind, namespace, name))

    def list(self, kind: Kind, namespace: str | None, label_selector: str | None = None) -> list[Obj]:
        return self._invoke(
            Action("list", kind.kind, namespace, None, body=label_selector),
            lambda: self.inner.list(kind, namespace, label_selector),
        )

    def create(self, obj: Obj) -> Obj:
        meta = obj["metadata"]
        return self._invoke(
            Action("create", obj["kind"], meta.get("namespace"), meta["name"], body=copy.deepcopy(obj)),
            lambda: self.inner.create(obj),
        )

    def merge_patch(self, kind: Kind, namespace: str | None, name: str, patch: Obj, sub: str | None = None) -> Obj:
        return self._invoke(
            Action("patch", kind.kind, namespace, name, sub, copy.deepcopy(patch)),
            lambda: self.inner.merge_patch(kind, namespace, name, patch, sub),
        )

    def delete(self, kind: Kind, namespace: str | None, name: str) -> None:
        self._invoke(Action("delete", kind.kind, namespace, name), lambda: self.inner.delete(kind, namespace, name))

    def post_event(self, involved: Obj, type_: ev.EventType, reason: str, message: str) -> None:
        meta = involved["metadata"]
        self._invoke(
            Action("event", involved["kind"], meta["namespace"], meta["name"], body=(type_, reason, message)),
            lambda: self.inner.post_event(involved, type_, reason, message),
        )


def _kind_of(obj: Obj) -> Kind:
    try:
        return KINDS[obj["kind"]]
    except KeyError:
        raise NotImplementedError(f"MemoryKube does not serve kind {obj.get('kind')!r}") from None


def _generation_content(kind: Kind, obj: Obj) -> Any:
    if kind.kind in CUSTOM:
        return {k: v for k, v in obj.items() if k not in ("metadata", "status")}
    return obj.get("spec")


class MemoryKube:
    """An in-memory `KubeClient` with the API server's semantics that a reconcile relies on."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], Obj] = {}
        self.events: list[tuple[str, str, ev.EventType, str, str]] = []  # (kind, name, type, reason, message)
        self._rv = itertools.count(1)
        self._uid = itertools.count(1)

    def get(self, kind: Kind, namespace: str | None, name: str) -> Obj | None:
        found = self.objects.get((kind.kind, namespace or "", name))
        return copy.deepcopy(found) if found is not None else None

    def list(self, kind: Kind, namespace: str | None, label_selector: str | None = None) -> list[Obj]:
        matches = selectors.parse_labels(label_selector)
        return [
            copy.deepcopy(obj)
            for (k, ns, _), obj in sorted(self.objects.items())
            if k == kind.kind
            and (namespace is None or ns == namespace)
            and matches(obj["metadata"].get("labels") or {})
        ]

    def create(self, obj: Obj) -> Obj:
        kind = _kind_of(obj)
        new = copy.deepcopy(obj)
        meta = new["metadata"]
        key = (kind.kind, meta.get("namespace") or "", meta["name"])
        if key in self.objects:
            path = kind.path(meta.get("namespace"))
            raise KubeError(409, "AlreadyExists", f'{kind.plural} "{meta["name"]}" already exists', "POST", path)
        if kind.kind in STATUS_SUBRESOURCE:
            new.pop("status", None)
        meta.update(
            uid=f"00000000-0000-4000-8000-{next(self._uid):012d}",
            resourceVersion=str(next(self._rv)),
            creationTimestamp="2026-12-01T00:00:00Z",
        )
        if kind.kind not in NO_GENERATION:
            meta["generation"] = 1
        self.objects[key] = new
        return copy.deepcopy(new)

    def merge_patch(self, kind: Kind, namespace: str | None, name: str, patch: Obj, sub: str | None = None) -> Obj:
        if sub not in (None, "status"):
            raise NotImplementedError(f"MemoryKube has no {sub!r} subresource")
        key = (kind.kind, namespace or "", name)
        old = self.objects.get(key)
        if old is None:
            path = kind.path(namespace, name, sub)
            raise KubeError(404, "NotFound", f'{kind.plural} "{name}" not found', "PATCH", path)
        want_rv = (patch.get("metadata") or {}).get("resourceVersion")
        if want_rv is not None and want_rv != old["metadata"]["resourceVersion"]:  # optimistic concurrency
            path = kind.path(namespace, name, sub)
            raise KubeError(409, "Conflict", f'{kind.plural} "{name}": the object has been modified', "PATCH", path)
        merged = patching.merge_patch(old, patch)
        new = copy.deepcopy(old)
        if sub == "status":
            new.pop("status", None)
            if merged.get("status") is not None:
                new["status"] = merged["status"]
        else:
            keep_status = kind.kind in STATUS_SUBRESOURCE
            for k in set(new) | set(merged):
                if k == "metadata" or (k == "status" and keep_status):
                    continue
                if k in merged:
                    new[k] = merged[k]
                else:
                    del new[k]
            for k in ("labels", "annotations", "ownerReferences", "finalizers"):  # the rest is the server's
                if k in merged["metadata"]:
                    new["metadata"][k] = merged["metadata"][k]
                else:
                    new["metadata"].pop(k, None)
        if new == old:
            return copy.deepcopy(old)  # a no-op write keeps the resourceVersion
        if _generation_content(kind, new) != _generation_content(kind, old):
            new["metadata"]["generation"] = int(old["metadata"]["generation"]) + 1
        new["metadata"]["resourceVersion"] = str(next(self._rv))
        self.objects[key] = new
        return copy.deepcopy(new)

    def delete(self, kind: Kind, namespace: str | None, name: str) -> None:
        self.objects.pop((kind.kind, namespace or "", name), None)

    def post_event(self, involved: Obj, type_: ev.EventType, reason: str, message: str) -> None:
        self.events.append((involved["kind"], involved["metadata"]["name"], type_, reason, message[: ev.MAX_MESSAGE]))


def fake_kube() -> Recorder:
    """The reconciler's fake client: a recorder over an empty in-memory cluster."""
    return Recorder(MemoryKube())


# ---- what the reconcile tests share ---------------------------------------------------------

NOW = "2026-12-01T00:00:00Z"
DEFAULTS = Defaults(image="img:1", broker_address="broker:50070")


def service(name: str, namespace: str, spec: Obj | None = None) -> Obj:
    return {
        "apiVersion": s.API_VERSION,
        "kind": s.KIND,
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec or {},
    }


def reconciler(kube: KubeClient, tokens: Iterator[str] | None = None) -> Reconciler:
    """A reconciler with a fixed clock and, unless given, tokens tok-1, tok-2, ..."""
    tokens = tokens or (f"tok-{i}" for i in itertools.count(1))
    return Reconciler(kube, NullBrokerView(), DEFAULTS, clock=lambda: NOW, token_factory=lambda: next(tokens))


def reconcile(rec: Reconciler, namespace: str, name: str) -> Outcome | None:
    return asyncio.run(rec.reconcile(namespace, name, "test"))
