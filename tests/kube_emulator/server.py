"""A Kubernetes API server emulator on kmock, strict enough for real kopf, kubectl and the client.

kmock's own `KubernetesEmulator` is a loose dict store (FACTS.md): no uid/resourceVersion/
generation, 200 on create, no label selectors, no watch resume, no PUT, no subresources, no
garbage collection, broken core discovery. This handler keeps kmock's server, request parsing
and reaction DSL (a test can still inject `emulator['get /api/v1/...'] << 500`), and serves
everything else from its own store with the API server's semantics:

- identity: uid, resourceVersion (one global counter), generation (spec changes only; for custom
  resources with a status subresource, any change outside metadata and status), timestamps;
- create answers 201, 409 AlreadyExists; update/patch answer 409 Conflict on a stale
  resourceVersion; a failed JSON-patch `test` is 422; `?dryRun=All` stores nothing;
- PUT, JSON/merge/strategic patches, no-op writes keep the resourceVersion and emit no event;
- status and scale subresources (the main endpoint ignores status, `/status` touches only it);
- list/watch with label and field selectors, watch from a resourceVersion (410 when too old),
  `timeoutSeconds`, bookmarks, `sendInitialEvents` with the initial-events-end bookmark;
- deletion with finalizers (deletionTimestamp first), ownerReference garbage collection (of an
  owner's dependents when it goes, and of an object created with only dangling owners);
- namespaces (objects need an existing namespace); CRDs admitted by the API server's own CRD
  validation (crd_validation.py, ported from apiextensions-apiserver) that register their resource
  at once; custom resources pruned, defaulted and validated in the API server's order, CEL rules
  with oldSelf and ratcheting included (schema.py), 422s worded as the API server words them;
- `?fieldValidation=Strict|Warn|Ignore` on custom-resource writes: the fields pruning drops are
  refused (400 strict decoding error) or sent back as Warning headers (Warn, the default);
- discovery in the legacy form (kubectl falls back from aggregated discovery), and server-side
  Tables with a CRD's printer columns for `kubectl get`;
- field ownership of Update operations (`metadata.managedFields`, managed_fields.py).

Not emulated: controllers (no pods appear; tests patch workload status themselves), protobuf
bodies, server-side apply field ownership, admission webhooks, RBAC.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import datetime
import json
import random
import string
import uuid
from collections.abc import Iterable
from typing import Any

import aiohttp.web
import attrs
import kmock
import yaml

from . import crd_validation, field, managed_fields, patching, resources, schema, selectors
from .resources import ResourceType

Obj = dict[str, Any]
ObjKey = tuple[str, str, str, str]  # group, plural, namespace ("" if cluster-scoped), name


class ApiError(Exception):
    """An error the API answers with a `Status` object."""

    def __init__(self, code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details or {}

    def status(self) -> Obj:
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "details": self.details,
            "code": self.code,
        }


@attrs.define
class AuditEntry:
    """One request, by whom (the bearer token stands for the user): see `rbac.py`.

    Logged when it arrives (a watch may stream for minutes); `status` is 0 until answered.
    """

    user: str
    method: str
    path: str
    query: dict[str, str]
    user_agent: str = ""
    status: int = 0


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _not_found(rtype: ResourceType, name: str) -> ApiError:
    what = f"{rtype.plural}.{rtype.group}" if rtype.group else rtype.plural
    return ApiError(
        404, "NotFound", f'{what} "{name}" not found', {"name": name, "group": rtype.group, "kind": rtype.plural}
    )


def _invalid(rtype: ResourceType, name: str, errors: list[field.FieldError]) -> ApiError:
    """`errors.NewInvalid`: 422 with one cause per field error (duplicates dropped, as ToAggregate does)."""
    what = f"{rtype.kind}.{rtype.group}" if rtype.group else rtype.kind
    unique: list[field.FieldError] = []
    for err in errors:
        if str(err) not in {str(u) for u in unique}:
            unique.append(err)
    causes = [{"reason": e.type, "message": e.body(), "field": e.field} for e in unique]
    return ApiError(
        422,
        "Invalid",
        field.invalid_message(what, name, unique),
        {"name": name, "group": rtype.group, "kind": rtype.kind, "causes": causes},
    )


def _dig(obj: Any, path: str) -> Any:
    cur = obj
    for part in path.strip(".").split("."):
        if not isinstance(cur, dict):
            return None
        cur = cur.get(part)
    return cur


def _put(obj: Obj, path: str, value: Any) -> None:
    parts = path.strip(".").split(".")
    cur = obj
    for part in parts[:-1]:
        cur = cur.setdefault(part, {})
    cur[parts[-1]] = value


@attrs.define(kw_only=True)
class KubeEmulator(kmock.KubernetesScaffold):
    """The handler; serve it with `kmock.Server(emulator)` (see `runner.EmulatorThread`)."""

    history_size: int = 50_000
    bookmark_interval: float = 5.0
    default_watch_timeout: float = 1800.0

    types: dict[tuple[str, str, str], ResourceType] = attrs.field(factory=dict)
    objects: dict[ObjKey, Obj] = attrs.field(factory=dict)
    rv: int = 1
    history: collections.deque[tuple[int, tuple[str, str], str, Obj]] = attrs.field(factory=collections.deque)
    watchers: set[Any] = attrs.field(factory=set)
    server_url: str = ""
    audit_log: list[AuditEntry] = attrs.field(factory=list)
    warnings: list[str] = attrs.field(factory=list)  # Warning headers of the request being served

    def __attrs_post_init__(self) -> None:
        # Deliberately not calling KubernetesScaffold's: its fallback reactions (a catch-all 404
        # and a core discovery advertising "/v1") would shadow this handler's own routing.
        for rtype in resources.BUILTINS:
            self.types[(rtype.group, rtype.version, rtype.plural)] = rtype
        for ns in ("default", "kube-system"):
            self._insert(
                self._type("", "namespaces"),
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}},
                event=False,
            )

    # ------------------------------------------------------------------ entry point

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        body = await raw_request.read()
        try:
            request = await kmock.Request._parse(raw_request, id=len(self._requests))
        except ValueError:
            # kmock's path parser cannot split `/api/v1/namespaces` (nothing after "namespaces");
            # this handler routes by path itself, so the HTTP part of the request is enough.
            request = kmock.Request(
                id=len(self._requests),
                raw_request=raw_request,
                url=raw_request.url,
                method=raw_request.method,
                params=dict(raw_request.query),
                headers=dict(raw_request.headers),
                body=body,
                text=body.decode("utf-8", "replace"),
            )
        self._requests.append(request)
        auth = raw_request.headers.get("Authorization", "")
        entry = AuditEntry(
            user=auth.removeprefix("Bearer ").strip(),
            method=raw_request.method.upper(),
            path=raw_request.url.path,
            query=dict(raw_request.query),
            user_agent=raw_request.headers.get("User-Agent", ""),
        )
        self.audit_log.append(entry)
        try:
            response = await self._handle(request)
        except Exception as exc:  # a bug here must reach the client as a 500 Status, not a hang
            err = ApiError(500, "InternalError", f"emulator error: {exc!r}")
            response = aiohttp.web.json_response(err.status(), status=500)
        entry.status = response.status
        return response

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        if self._payloads:  # reactions a test injected take precedence (fault injection)
            try:
                return await super()._handle(request)
            except NotImplementedError:
                pass
        self.warnings = []
        try:
            response = await self._serve(request)
        except ApiError as exc:
            response = aiohttp.web.json_response(exc.status(), status=exc.code)
        for text in self.warnings:  # k8s.io/apiserver pkg/warning: `299 - "text"`, one header each
            response.headers.add("Warning", f"299 - {json.dumps(text)}")
        return response

    async def _serve(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        path = request.url.path.rstrip("/") or "/"
        method = str(request.method.value).upper()
        params = dict(request.params)
        params["_manager"] = managed_fields.manager_of(params, request.headers.get("User-Agent", ""))
        if method == "GET":
            doc = self._discovery(path)
            if doc is not None:
                return aiohttp.web.json_response(doc)
        rtype, ns, name, sub = self._route(path)
        if method == "GET" and params.get("watch") in ("true", "1"):
            return await self._watch(request, rtype, ns, name, params)
        if method == "GET" and name is None:
            return self._json(self._list(rtype, ns, params), request)
        if method == "GET":
            return self._json(self._read(rtype, ns, name, sub), request)
        if method == "POST" and name is None:
            body = self._body(request)
            return aiohttp.web.json_response(self._create(rtype, ns, body, params), status=201)
        if name is None:
            if method == "DELETE":
                return aiohttp.web.json_response(self._delete_collection(rtype, ns, params))
            raise ApiError(405, "MethodNotAllowed", f"{method} is not supported on a collection")
        if method == "PUT":
            return aiohttp.web.json_response(self._replace(rtype, ns, name, sub, self._body(request), params))
        if method == "PATCH":
            ctype = request.headers.get("Content-Type", "application/merge-patch+json")
            body = self._body(request, yaml_ok=True)
            return aiohttp.web.json_response(self._patch(rtype, ns, name, sub, body, ctype, params))
        if method == "DELETE":
            body = self._body(request, optional=True) or {}
            return aiohttp.web.json_response(self._delete(rtype, ns, name, params, body))
        raise ApiError(405, "MethodNotAllowed", f"{method} is not supported on {path}")

    @staticmethod
    def _body(request: kmock.Request, *, yaml_ok: bool = False, optional: bool = False) -> Any:
        if not request.body:
            if optional:
                return None
            raise ApiError(400, "BadRequest", "the request has no body")
        try:
            return json.loads(request.body)
        except ValueError:
            if yaml_ok:
                try:
                    return yaml.safe_load(request.body)
                except yaml.YAMLError:
                    pass
            if request.body[:1] == b"k8s":
                raise ApiError(415, "UnsupportedMediaType", "protobuf bodies are not supported") from None
            raise ApiError(400, "BadRequest", "the request body is neither JSON nor YAML") from None

    def _json(self, doc: Obj, request: kmock.Request) -> aiohttp.web.StreamResponse:
        if "as=Table" in request.headers.get("Accept", "") and doc.get("kind") != "Table":
            doc = self._table(doc)
        return aiohttp.web.json_response(doc)

    # ------------------------------------------------------------------ routing & discovery

    def _type(self, group: str, plural: str, version: str | None = None) -> ResourceType:
        for (g, v, p), rtype in self.types.items():
            if g == group and p == plural and (version is None or v == version):
                return rtype
        raise ApiError(404, "NotFound", f"the server could not find the requested resource ({group}/{plural})")

    def _route(self, path: str) -> tuple[ResourceType, str | None, str | None, str | None]:
        parts = path.strip("/").split("/")
        if parts[0] == "api" and len(parts) >= 3:
            group, version, rest = "", parts[1], parts[2:]
        elif parts[0] == "apis" and len(parts) >= 4:
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource: {path}")
        ns = None
        if rest[0] == "namespaces" and len(rest) >= 3:
            candidate = next(
                (t for (g, v, p), t in self.types.items() if g == group and v == version and p == rest[2]), None
            )
            if candidate is not None and candidate.namespaced:
                ns, rest = rest[1], rest[2:]
        rtype = self._type(group, rest[0], version)
        name = rest[1] if len(rest) > 1 else None
        sub = "/".join(rest[2:]) or None
        if rtype.namespaced and ns is None and name is not None:
            raise ApiError(404, "NotFound", f"{rtype.plural} is namespaced: use /namespaces/NS/{rtype.plural}/{name}")
        if (
            sub is not None
            and sub not in ("status", "scale")
            or sub == "scale"
            and rtype.scale is None
            or sub == "status"
            and not rtype.status
        ):
            raise ApiError(404, "NotFound", f"the server could not find the requested resource: {path}")
        return rtype, ns, name, sub

    def _resource_list(self, group: str, version: str) -> Obj | None:
        found = [t for (g, v, _), t in self.types.items() if g == group and v == version]
        if not found:
            return None
        items = []
        for t in found:
            items.append(
                {
                    "name": t.plural,
                    "singularName": t.singular,
                    "namespaced": t.namespaced,
                    "kind": t.kind,
                    "verbs": list(t.verbs),
                    "shortNames": list(t.short_names),
                    "categories": list(t.categories),
                }
            )
            if t.status:
                items.append(
                    {
                        "name": f"{t.plural}/status",
                        "singularName": "",
                        "namespaced": t.namespaced,
                        "kind": t.kind,
                        "verbs": ["get", "patch", "update"],
                    }
                )
            if t.scale is not None:
                items.append(
                    {
                        "name": f"{t.plural}/scale",
                        "singularName": "",
                        "namespaced": t.namespaced,
                        "group": "autoscaling",
                        "version": "v1",
                        "kind": "Scale",
                        "verbs": ["get", "patch", "update"],
                    }
                )
        return {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": f"{group}/{version}" if group else version,
            "resources": items,
        }

    def _groups(self) -> dict[str, list[str]]:
        groups: dict[str, list[str]] = {}
        for g, v, _ in self.types:
            if g and v not in groups.setdefault(g, []):
                groups[g].append(v)
        return groups

    def _group_doc(self, group: str, versions: list[str]) -> Obj:
        gvs = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
        return {"name": group, "versions": gvs, "preferredVersion": gvs[0]}

    def _discovery(self, path: str) -> Obj | None:
        if path == "/version":
            return {"major": "1", "minor": "32", "gitVersion": "v1.32.0-pdserve-emulator", "platform": "linux/amd64"}
        if path == "/api":
            return {
                "kind": "APIVersions",
                "versions": ["v1"],
                "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}],
            }
        if path == "/apis":
            return {
                "kind": "APIGroupList",
                "apiVersion": "v1",
                "groups": [self._group_doc(g, vs) for g, vs in sorted(self._groups().items())],
            }
        if path == "/":
            return {"paths": ["/api", "/api/v1", "/apis", "/version"]}
        parts = path.strip("/").split("/")
        if parts[0] == "openapi":
            raise ApiError(404, "NotFound", "no OpenAPI documents are served (use --validate=false)")
        if parts == ["api", "v1"]:
            return self._resource_list("", "v1")
        if parts[0] == "apis" and len(parts) == 2:
            versions = self._groups().get(parts[1])
            if versions is None:
                raise ApiError(404, "NotFound", f"the server could not find the requested resource: {path}")
            return {"kind": "APIGroup", "apiVersion": "v1", **self._group_doc(parts[1], versions)}
        if parts[0] == "apis" and len(parts) == 3:
            doc = self._resource_list(parts[1], parts[2])
            if doc is None:
                raise ApiError(404, "NotFound", f"the server could not find the requested resource: {path}")
            return doc
        return None

    # ------------------------------------------------------------------ store primitives

    def _key(self, rtype: ResourceType, ns: str | None, name: str) -> ObjKey:
        return (rtype.group, rtype.plural, (ns or "") if rtype.namespaced else "", name)

    def _next_rv(self) -> str:
        self.rv += 1
        return str(self.rv)

    def _emit(self, rtype: ResourceType, event_type: str, obj: Obj) -> None:
        rv = int(obj["metadata"]["resourceVersion"])
        self.history.append((rv, rtype.key, event_type, obj))
        while len(self.history) > self.history_size:
            self.history.popleft()
        for watcher in list(self.watchers):
            watcher.offer(rtype.key, event_type, obj)

    def _with_identity(self, rtype: ResourceType, obj: Obj) -> Obj:
        obj["apiVersion"], obj["kind"] = rtype.api_version, rtype.kind
        return obj

    def _insert(self, rtype: ResourceType, obj: Obj, event: bool = True) -> Obj:
        meta = obj.setdefault("metadata", {})
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = _now()
        meta["resourceVersion"] = self._next_rv()
        meta["generation"] = 1
        if rtype.plural == "namespaces":
            obj["status"] = {"phase": "Active"}
        self._with_identity(rtype, obj)
        self.objects[self._key(rtype, meta.get("namespace"), meta["name"])] = obj
        if event:
            self._emit(rtype, "ADDED", obj)
        return obj

    def _get(self, rtype: ResourceType, ns: str | None, name: str) -> Obj:
        obj = self.objects.get(self._key(rtype, ns, name))
        if obj is None:
            raise _not_found(rtype, name)
        return obj

    def _content_changed(self, rtype: ResourceType, old: Obj, new: Obj) -> bool:
        if rtype.generation_paths == ("*",):
            skip = {"metadata", "status"} if rtype.status else {"metadata"}
            keys = (set(old) | set(new)) - skip
        else:
            keys = set(rtype.generation_paths)
        return any(old.get(k) != new.get(k) for k in keys)

    # ------------------------------------------------------------------ admission

    def _admit(self, rtype: ResourceType, obj: Obj, old: Obj | None = None, sub: str | None = None) -> Obj:
        """Decode (prune, default) and validate a custom resource or a CRD as the API server does;
        `old` is the stored object on update, `sub` the subresource written ("status")."""
        name = obj.get("metadata", {}).get("name", "")
        if rtype.custom:
            version = schema.Version(
                rtype.group, rtype.version, rtype.kind, rtype.schema, rtype.status, rtype.scale_spec
            )
            stored = schema.decode(obj, version)
            if old is None:
                errors = schema.validate_create(stored, version)
            else:
                errors = schema.validate_update(stored, old, version, status_only=sub == "status")
            if errors:
                raise _invalid(rtype, name, errors)
            return stored
        if rtype.plural == "customresourcedefinitions" and sub is None:
            obj = crd_validation.set_defaults(obj)
            errors = crd_validation.validate_crd(obj)
            if errors:
                raise _invalid(rtype, name, errors)
        return obj

    def _check_unknown_fields(self, rtype: ResourceType, obj: Obj, params: dict[str, str]) -> None:
        """Server-side field validation of a custom resource's body (k8s.io/apiserver at 24a394e5,
        `endpoints/handlers/rest.go` `fieldValidation`: Warn when unset; create.go/update.go/patch.go:
        a strict decoding error is a 400 under Strict, Warning headers under Warn, nothing under
        Ignore). The unknown fields are those pruning drops (apiextensions-apiserver at 1aa2717a,
        `customresource_handler.go` `schemaCoercingDecoder.Decode`: `unknown field "spec.x"`)."""
        directive = params.get("fieldValidation") or "Warn"
        if directive not in ("Ignore", "Warn", "Strict"):
            raise ApiError(
                422,
                "Invalid",
                f'fieldValidation: Unsupported value: "{directive}": supported values: "Ignore", "Strict", "Warn"',
            )
        if directive == "Ignore" or not rtype.custom or rtype.schema is None:
            return
        unknown = [f'unknown field "{path}"' for path in schema.unknown_fields(obj, rtype.schema)]
        if unknown and directive == "Strict":
            raise ApiError(400, "BadRequest", "strict decoding error: " + ", ".join(unknown))
        self.warnings.extend(unknown)

    def _register_crd(self, crd: Obj) -> None:
        for rtype in resources.from_crd(crd):
            self.types[(rtype.group, rtype.version, rtype.plural)] = rtype
        names = crd["spec"]["names"]
        crd["status"] = {
            "acceptedNames": names,
            "storedVersions": [v["name"] for v in crd["spec"]["versions"] if v.get("storage")],
            "conditions": [
                {"type": t, "status": "True", "reason": r, "message": m, "lastTransitionTime": _now()}
                for t, r, m in (
                    ("NamesAccepted", "NoConflicts", "no conflicts found"),
                    ("Established", "InitialNamesAccepted", "the initial names have been accepted"),
                )
            ],
        }

    def _unregister_crd(self, crd: Obj) -> None:
        group, plural = crd["spec"]["group"], crd["spec"]["names"]["plural"]
        for key in [k for k in self.types if k[0] == group and k[2] == plural]:
            rtype = self.types.pop(key)
            for okey in [k for k in self.objects if k[:2] == (group, plural)]:
                self._remove(rtype, okey)

    # ------------------------------------------------------------------ verbs

    def _list(self, rtype: ResourceType, ns: str | None, params: dict[str, str]) -> Obj:
        items = [copy.deepcopy(o) for o in self._select(rtype, ns, params)]
        return {
            "apiVersion": rtype.api_version,
            "kind": f"{rtype.kind}List",
            "metadata": {"resourceVersion": str(self.rv)},
            "items": items,
        }

    def _select(self, rtype: ResourceType, ns: str | None, params: dict[str, str]) -> Iterable[Obj]:
        try:
            labels = selectors.parse_labels(params.get("labelSelector"))
            fields = selectors.parse_fields(params.get("fieldSelector"))
        except selectors.SelectorError as exc:
            raise ApiError(400, "BadRequest", str(exc)) from exc
        for (g, p, ons, _), obj in sorted(self.objects.items()):
            if (g, p) != rtype.key or (ns is not None and rtype.namespaced and ons != ns):
                continue
            if labels(obj["metadata"].get("labels") or {}) and fields(obj):
                yield obj

    def _read(self, rtype: ResourceType, ns: str | None, name: str, sub: str | None) -> Obj:
        obj = self._get(rtype, ns, name)
        if sub == "scale":
            return self._scale_of(rtype, obj)
        return copy.deepcopy(obj)

    def _create(self, rtype: ResourceType, ns: str | None, body: Any, params: dict[str, str]) -> Obj:
        if not isinstance(body, dict):
            raise ApiError(400, "BadRequest", "the body of a create must be an object")
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if rtype.namespaced:
            if meta.get("namespace") and ns and meta["namespace"] != ns:
                raise ApiError(400, "BadRequest", "the namespace of the object does not match the namespace of the URL")
            meta["namespace"] = ns or meta.get("namespace") or "default"
            if ("", "namespaces", "", meta["namespace"]) not in self.objects:
                raise ApiError(404, "NotFound", f'namespaces "{meta["namespace"]}" not found')
        else:
            meta.pop("namespace", None)
        if not meta.get("name"):
            prefix = meta.get("generateName")
            if not prefix:
                raise _invalid(
                    rtype, "", [field.required(field.Path("metadata", "name"), "name or generateName is required")]
                )
            meta["name"] = prefix + "".join(random.choices(string.ascii_lowercase + string.digits, k=5))
        if self._key(rtype, meta.get("namespace"), meta["name"]) in self.objects:
            what = f"{rtype.plural}.{rtype.group}" if rtype.group else rtype.plural
            raise ApiError(
                409,
                "AlreadyExists",
                f'{what} "{meta["name"]}" already exists',
                {"name": meta["name"], "group": rtype.group, "kind": rtype.plural},
            )
        for key in ("uid", "resourceVersion", "generation", "creationTimestamp", "deletionTimestamp"):
            meta.pop(key, None)
        if rtype.status and rtype.plural != "customresourcedefinitions":
            obj.pop("status", None)
        if rtype.plural == "services" and obj.get("spec", {}).get("clusterIP") != "None":
            obj.setdefault("spec", {})["clusterIP"] = f"10.96.{random.randint(0, 255)}.{random.randint(1, 254)}"
        self._check_unknown_fields(rtype, obj, params)
        obj = self._with_identity(rtype, self._admit(rtype, self._with_identity(rtype, obj)))
        if params.get("dryRun") == "All":
            obj["metadata"].update(uid=str(uuid.uuid4()), creationTimestamp=_now(), generation=1)
            return obj
        if rtype.plural == "customresourcedefinitions":
            self._register_crd(obj)
        obj["metadata"].pop("managedFields", None)
        if "_manager" in params:
            managed_fields.record_update(None, obj, params["_manager"], None, _now())
        stored = copy.deepcopy(self._insert(rtype, obj))
        self._collect_if_orphaned(rtype, stored)
        return stored

    def _collect_if_orphaned(self, rtype: ResourceType, obj: Obj) -> None:
        """The garbage collector's rule for an object created after its owners went away
        (kubernetes pkg/controller/garbagecollector/garbagecollector.go, `attemptToDeleteItem` with
        `classifyReferences`: an owner that is absent, or present under another uid, is dangling;
        an item whose owner references are all dangling is deleted, in the background). The real
        collector does it asynchronously; here it follows the create at once. (A controller whose
        reconcile read its owner just before the owner's deletion can create such a child, or
        adopt one by updating its references.)"""
        refs = obj["metadata"].get("ownerReferences") or []
        if not refs:
            return
        live = {o["metadata"].get("uid") for o in self.objects.values()}
        if any(r.get("uid") in live for r in refs):
            return
        meta = obj["metadata"]
        self._delete(rtype, meta.get("namespace"), meta["name"], {}, {})

    def _replace(
        self, rtype: ResourceType, ns: str | None, name: str, sub: str | None, body: Any, params: dict[str, str]
    ) -> Obj:
        old = self._get(rtype, ns, name)
        if not isinstance(body, dict):
            raise ApiError(400, "BadRequest", "the body of an update must be an object")
        if sub == "scale":
            return self._write_scale(rtype, old, body, params)
        return self._update(rtype, old, copy.deepcopy(body), sub, params)

    def _patch(
        self,
        rtype: ResourceType,
        ns: str | None,
        name: str,
        sub: str | None,
        body: Any,
        ctype: str,
        params: dict[str, str],
    ) -> Obj:
        if ctype.startswith("application/apply-patch") and self._key(rtype, ns, name) not in self.objects:
            return self._create(rtype, ns, body, params)  # server-side apply creates
        old = self._get(rtype, ns, name)
        base = self._scale_of(rtype, old) if sub == "scale" else copy.deepcopy(old)
        try:
            new = patching.apply(base, body, ctype, custom=rtype.custom)
        except patching.PatchError as exc:
            reason = {400: "BadRequest", 415: "UnsupportedMediaType"}.get(exc.status, "Invalid")
            raise ApiError(exc.status, reason, str(exc)) from exc
        if isinstance(body, dict) and _dig(body, "metadata.resourceVersion") is None:
            new.setdefault("metadata", {})["resourceVersion"] = old["metadata"]["resourceVersion"]  # unconditional
        if ctype.startswith("application/apply-patch"):
            params = {**params, "_apply": "1"}  # no ownership recorded for applies (managed_fields.py)
        if sub == "scale":
            return self._write_scale(rtype, old, new, params)
        return self._update(rtype, old, new, sub, params)

    def _update(self, rtype: ResourceType, old: Obj, new: Obj, sub: str | None, params: dict[str, str]) -> Obj:
        meta_old = old["metadata"]
        meta_new = new.setdefault("metadata", {})
        want_rv = meta_new.get("resourceVersion")
        if want_rv and want_rv != meta_old["resourceVersion"]:
            what = f"{rtype.plural}.{rtype.group}" if rtype.group else rtype.plural
            raise ApiError(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on {what} "{meta_old["name"]}": the object has been '
                "modified; please apply your changes to the latest version and try again",
                {"name": meta_old["name"], "group": rtype.group, "kind": rtype.plural},
            )
        if meta_new.get("name", meta_old["name"]) != meta_old["name"]:
            raise ApiError(400, "BadRequest", "the name of the object does not match the name in the URL")
        if sub == "status":
            candidate = copy.deepcopy(old)
            if "status" in new:
                candidate["status"] = new["status"]
            else:
                candidate.pop("status", None)
        else:
            candidate = new
            if rtype.status:
                if "status" in old:
                    candidate["status"] = copy.deepcopy(old["status"])
                else:
                    candidate.pop("status", None)
        cmeta = candidate.setdefault("metadata", {})
        for key in (
            "uid",
            "creationTimestamp",
            "namespace",
            "name",
            "generation",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
        ):
            if key in meta_old:
                cmeta[key] = meta_old[key]
            else:
                cmeta.pop(key, None)
        cmeta["resourceVersion"] = meta_old["resourceVersion"]
        if "managedFields" in meta_old:  # the server's record: what a client sends is ignored here
            cmeta["managedFields"] = copy.deepcopy(meta_old["managedFields"])
        else:
            cmeta.pop("managedFields", None)
        if meta_old.get("deletionTimestamp"):
            added = set(cmeta.get("finalizers") or []) - set(meta_old.get("finalizers") or [])
            if added:
                raise ApiError(422, "Invalid", "no new finalizers can be added if the object is being deleted")
        self._check_unknown_fields(rtype, candidate, params)
        candidate = self._with_identity(
            rtype, self._admit(rtype, self._with_identity(rtype, candidate), old if meta_old.get("uid") else None, sub)
        )
        cmeta = candidate["metadata"]  # admission returns new dicts
        if candidate == old:
            return copy.deepcopy(old)  # a no-op write: same resourceVersion, no event
        if self._content_changed(rtype, old, candidate):
            cmeta["generation"] = int(meta_old.get("generation", 1)) + 1
        if "_manager" in params and not params.get("_apply"):
            managed_fields.record_update(old, candidate, params["_manager"], params.get("_subresource", sub), _now())
        if params.get("dryRun") == "All":
            return candidate
        if rtype.plural == "customresourcedefinitions" and sub is None:
            self._register_crd(candidate)
        cmeta["resourceVersion"] = self._next_rv()
        key = self._key(rtype, cmeta.get("namespace"), cmeta["name"])
        self.objects[key] = candidate
        self._emit(rtype, "MODIFIED", candidate)
        if cmeta.get("deletionTimestamp") and not cmeta.get("finalizers"):
            self._remove(rtype, key)
        elif cmeta.get("ownerReferences") != meta_old.get("ownerReferences"):
            # The collector's graph builder sees the references change (`processGraphChanges`):
            # an item whose owners are now all dangling is collected, as at create.
            written = copy.deepcopy(candidate)
            self._collect_if_orphaned(rtype, candidate)
            return written
        return copy.deepcopy(candidate)

    def _scale_of(self, rtype: ResourceType, obj: Obj) -> Obj:
        assert rtype.scale is not None
        sc = rtype.scale
        if sc.selector_from_match_labels:
            labels = _dig(obj, "spec.selector.matchLabels") or {}
            selector = ",".join(f"{k}={v}" for k, v in labels.items())
        else:
            selector = _dig(obj, sc.selector_path) if sc.selector_path else None
        meta = obj["metadata"]
        status: Obj = {"replicas": int(_dig(obj, sc.status_path) or 0)}
        if selector:
            status["selector"] = selector
        return {
            "kind": "Scale",
            "apiVersion": "autoscaling/v1",
            "metadata": {
                k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp") if k in meta
            },
            "spec": {"replicas": int(_dig(obj, sc.spec_path) or 0)},
            "status": status,
        }

    def _write_scale(self, rtype: ResourceType, old: Obj, scale: Obj, params: dict[str, str]) -> Obj:
        assert rtype.scale is not None
        replicas = _dig(scale, "spec.replicas")
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
            raise ApiError(
                422, "Invalid", f"spec.replicas: Invalid value: {replicas!r}: must be a non-negative integer"
            )
        new = copy.deepcopy(old)
        _put(new, rtype.scale.spec_path, replicas)
        new["metadata"]["resourceVersion"] = (
            _dig(scale, "metadata.resourceVersion") or old["metadata"]["resourceVersion"]
        )
        stored = self._update(rtype, old, new, None, {**params, "_subresource": "scale"})
        return self._scale_of(rtype, stored)

    def _delete(self, rtype: ResourceType, ns: str | None, name: str, params: dict[str, str], body: Obj) -> Obj:
        obj = self._get(rtype, ns, name)
        key = self._key(rtype, ns, name)
        pre_uid = _dig(body, "preconditions.uid")
        if pre_uid and pre_uid != obj["metadata"]["uid"]:
            raise ApiError(409, "Conflict", f"precondition failed: uid {pre_uid} != {obj['metadata']['uid']}")
        if params.get("dryRun") == "All":
            return copy.deepcopy(obj)
        policy = body.get("propagationPolicy") or params.get("propagationPolicy") or "Background"
        if obj["metadata"].get("finalizers"):
            if not obj["metadata"].get("deletionTimestamp"):
                new = copy.deepcopy(obj)
                new["metadata"]["deletionTimestamp"] = _now()
                new["metadata"]["deletionGracePeriodSeconds"] = 0
                new["metadata"]["resourceVersion"] = self._next_rv()
                self.objects[key] = new
                self._emit(rtype, "MODIFIED", new)
                return copy.deepcopy(new)
            return copy.deepcopy(obj)
        self._remove(rtype, key, orphan=policy == "Orphan")
        return copy.deepcopy(obj)

    def _delete_collection(self, rtype: ResourceType, ns: str | None, params: dict[str, str]) -> Obj:
        for obj in list(self._select(rtype, ns, params)):
            self._delete(rtype, obj["metadata"].get("namespace"), obj["metadata"]["name"], params, {})
        return {"kind": "Status", "apiVersion": "v1", "status": "Success", "metadata": {}}

    def _remove(self, rtype: ResourceType, key: ObjKey, orphan: bool = False) -> None:
        """Really delete, then collect what it owned (or orphan it) and what lived in it."""
        obj = self.objects.pop(key, None)
        if obj is None:
            return
        gone = copy.deepcopy(obj)
        gone["metadata"]["resourceVersion"] = self._next_rv()
        self._emit(rtype, "DELETED", gone)
        if rtype.plural == "customresourcedefinitions":
            self._unregister_crd(obj)
        uid = obj["metadata"]["uid"]
        for okey, dep in list(self.objects.items()):
            refs = dep["metadata"].get("ownerReferences") or []
            if not any(r.get("uid") == uid for r in refs):
                continue
            dtype = self._type(okey[0], okey[1])
            if orphan:
                new = copy.deepcopy(dep)
                new["metadata"]["ownerReferences"] = [r for r in refs if r.get("uid") != uid]
                new["metadata"]["resourceVersion"] = self._next_rv()
                self.objects[okey] = new
                self._emit(dtype, "MODIFIED", new)
            elif okey in self.objects:
                self._delete(dtype, okey[2] or None, okey[3], {}, {})
        if rtype.plural == "namespaces":
            for okey in [k for k in self.objects if k[2] == key[3] and self._type(k[0], k[1]).namespaced]:
                self._remove(self._type(okey[0], okey[1]), okey)

    # ------------------------------------------------------------------ watch

    async def _watch(
        self, request: kmock.Request, rtype: ResourceType, ns: str | None, name: str | None, params: dict[str, str]
    ) -> aiohttp.web.StreamResponse:
        if name is not None:
            params = {
                **params,
                "fieldSelector": ",".join(filter(None, [params.get("fieldSelector"), f"metadata.name={name}"])),
            }
        try:
            labels = selectors.parse_labels(params.get("labelSelector"))
            fields = selectors.parse_fields(params.get("fieldSelector"))
        except selectors.SelectorError as exc:
            raise ApiError(400, "BadRequest", str(exc)) from exc

        def wanted(obj: Obj) -> bool:
            meta = obj["metadata"]
            if ns is not None and rtype.namespaced and meta.get("namespace") != ns:
                return False
            return labels(meta.get("labels") or {}) and fields(obj)

        watcher = _Watcher(rtype.key, wanted)
        since = params.get("resourceVersion") or ""
        initial: list[tuple[str, Obj]] = []
        send_initial = params.get("sendInitialEvents") == "true"
        if send_initial or since in ("", "0"):
            initial = [("ADDED", o) for o in self._select(rtype, ns, params)]
            since = str(self.rv)
        else:
            oldest = self.history[0][0] if self.history else self.rv + 1
            if int(since) < oldest - 1 and int(since) < self.rv:
                return await self._stream(
                    request,
                    [
                        (
                            "ERROR",
                            {
                                "kind": "Status",
                                "apiVersion": "v1",
                                "status": "Failure",
                                "code": 410,
                                "reason": "Expired",
                                "message": f"too old resource version: {since} ({oldest - 1})",
                            },
                        )
                    ],
                    None,
                    0,
                    False,
                )
            for rv, rkey, etype, obj in self.history:
                if rv > int(since) and rkey == rtype.key and wanted(obj):
                    initial.append((etype, obj))
        if send_initial:
            initial.append(
                (
                    "BOOKMARK",
                    {
                        "kind": rtype.kind,
                        "apiVersion": rtype.api_version,
                        "metadata": {
                            "resourceVersion": str(self.rv),
                            "annotations": {"k8s.io/initial-events-end": "true"},
                        },
                    },
                )
            )
        self.watchers.add(watcher)  # registered in the same step as the snapshot: no gap
        timeout = float(params.get("timeoutSeconds") or self.default_watch_timeout)
        bookmarks = params.get("allowWatchBookmarks") == "true"
        try:
            return await self._stream(request, initial, watcher, timeout, bookmarks, rtype)
        finally:
            self.watchers.discard(watcher)

    async def _stream(
        self,
        request: kmock.Request,
        initial: list[tuple[str, Obj]],
        watcher: _Watcher | None,
        timeout: float,
        bookmarks: bool,
        rtype: ResourceType | None = None,
    ) -> aiohttp.web.StreamResponse:
        response = aiohttp.web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        await response.prepare(request._raw_request)

        async def send(etype: str, obj: Obj) -> None:
            await response.write(json.dumps({"type": etype, "object": obj}).encode() + b"\n")

        try:
            for etype, obj in initial:
                await send(etype, obj)
            if watcher is not None:
                loop = asyncio.get_running_loop()
                deadline = loop.time() + timeout
                while (left := deadline - loop.time()) > 0:
                    try:
                        etype, obj = await asyncio.wait_for(watcher.queue.get(), min(left, self.bookmark_interval))
                    except TimeoutError:
                        if bookmarks and rtype is not None:
                            await send(
                                "BOOKMARK",
                                {
                                    "kind": rtype.kind,
                                    "apiVersion": rtype.api_version,
                                    "metadata": {"resourceVersion": str(self.rv)},
                                },
                            )
                        continue
                    await send(etype, obj)
            await response.write_eof()
        except (ConnectionResetError, ConnectionError, asyncio.CancelledError):
            pass
        return response

    # ------------------------------------------------------------------ tables (kubectl get)

    def _table(self, doc: Obj) -> Obj:
        items = doc["items"] if doc.get("kind", "").endswith("List") else [doc]
        kind = doc["kind"][:-4] if doc.get("kind", "").endswith("List") else doc.get("kind", "")
        rtype = next(
            (t for t in self.types.values() if t.kind == kind and t.api_version == doc.get("apiVersion")), None
        )
        extra = [
            c for c in (rtype.printer_columns if rtype else ()) if c.get("jsonPath") != ".metadata.creationTimestamp"
        ]
        columns = [{"name": "Name", "type": "string", "format": "name", "description": "Name", "priority": 0}]
        columns += [
            {
                "name": c["name"],
                "type": c.get("type", "string"),
                "format": "",
                "description": c.get("description", ""),
                "priority": c.get("priority", 0),
            }
            for c in extra
        ]
        columns.append({"name": "Age", "type": "string", "format": "", "description": "Age", "priority": 0})
        rows = []
        for obj in items:
            cells = [obj["metadata"]["name"]]
            for c in extra:
                value = _dig(obj, c["jsonPath"])
                cells.append("" if value is None else value)
            cells.append(_age(obj["metadata"].get("creationTimestamp")))
            rows.append({"cells": cells, "object": obj})
        return {
            "kind": "Table",
            "apiVersion": "meta.k8s.io/v1",
            "metadata": {"resourceVersion": doc.get("metadata", {}).get("resourceVersion", str(self.rv))},
            "columnDefinitions": columns,
            "rows": rows,
        }


def _age(stamp: str | None) -> str:
    if not stamp:
        return "<unknown>"
    then = datetime.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)
    secs = int((datetime.datetime.now(datetime.UTC) - then).total_seconds())
    return f"{secs}s" if secs < 120 else f"{secs // 60}m"


class _Watcher:
    """One open watch: a queue of events of one resource type that pass its filter."""

    def __init__(self, rkey: tuple[str, str], wanted: Any) -> None:
        self.rkey = rkey
        self.wanted = wanted
        self.queue: asyncio.Queue[tuple[str, Obj]] = asyncio.Queue()

    def offer(self, rkey: tuple[str, str], etype: str, obj: Obj) -> None:
        if rkey == self.rkey and self.wanted(obj):
            self.queue.put_nowait((etype, obj))
