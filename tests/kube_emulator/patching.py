"""The three PATCH bodies of the Kubernetes API, applied to plain dicts.

- JSON patch (RFC 6902) via the `jsonpatch` library; a failed `test` op is a 422, as kopf's
  finalizer patches rely on (they test `/metadata/resourceVersion`).
- JSON merge patch (RFC 7386), hand-written because it is ten lines and has no quirks.
- Strategic merge patch, simplified: like a merge patch, but lists the Kubernetes Go types
  mark as "merge by key" (containers by name, ports by port, conditions by type, ...) are
  merged item by item, `$patch: delete|replace` items are honoured and kubectl's
  `$setElementOrder/...` and `$retainKeys` directives are dropped. Enough for kubectl's
  client-side apply and `kubectl patch` on built-in kinds; not the full Go implementation.
"""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch

# Merge keys of the built-in list fields an operator or kubectl touch.
_MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "env": "name",
    "conditions": "type",
    "ownerReferences": "uid",
    "imagePullSecrets": "name",
    "versions": "name",
}
# `ports` merge on containerPort inside containers, on port inside Services.
_PORT_KEYS = ("containerPort", "port")


class PatchError(ValueError):
    """The patch cannot apply; `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 422) -> None:
        super().__init__(message)
        self.status = status


def json_patch(doc: dict[str, Any], ops: Any) -> dict[str, Any]:
    if not isinstance(ops, list):
        raise PatchError("a JSON patch must be a list of operations", 400)
    try:
        return jsonpatch.JsonPatch(ops).apply(doc, in_place=False)
    except jsonpatch.JsonPatchTestFailed as exc:
        raise PatchError(f"the server rejected our request due to an error in our request: {exc}") from exc
    except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
        raise PatchError(f"the server rejected our request due to an error in our request: {exc}") from exc


def merge_patch(doc: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(doc) if isinstance(doc, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def _list_key(field: str, items: list[Any]) -> str | None:
    if field in _MERGE_KEYS:
        return _MERGE_KEYS[field]
    if field == "ports":
        for key in _PORT_KEYS:
            if all(isinstance(i, dict) and key in i for i in items):
                return key
    return None


def strategic_merge_patch(doc: Any, patch: Any, field: str = "") -> Any:
    if isinstance(patch, list):
        return _strategic_list(doc if isinstance(doc, list) else [], patch, field)
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    if patch.get("$patch") == "delete":
        return None
    out = dict(doc) if isinstance(doc, dict) else {}
    for key, value in patch.items():
        if key.startswith("$setElementOrder/") or key in ("$retainKeys", "$patch"):
            continue
        if key.startswith("$deleteFromPrimitiveList/"):
            name = key.split("/", 1)[1]
            out[name] = [v for v in out.get(name) or [] if v not in value]
            continue
        if value is None:
            out.pop(key, None)
        else:
            out[key] = strategic_merge_patch(out.get(key), value, key)
    return out


def _strategic_list(doc: list[Any], patch: list[Any], field: str) -> list[Any]:
    key = _list_key(field, patch + doc)
    if key is None:
        return [item for item in copy.deepcopy(patch) if not (isinstance(item, dict) and item.get("$patch"))]
    out = [copy.deepcopy(i) for i in doc]
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            raise PatchError(f"{field}: every item of a strategic merge list needs {key!r}")
        idx = next((n for n, cur in enumerate(out) if isinstance(cur, dict) and cur.get(key) == item[key]), None)
        if item.get("$patch") == "delete":
            if idx is not None:
                del out[idx]
            continue
        if idx is None:
            out.append(strategic_merge_patch({}, item, field))
        else:
            out[idx] = strategic_merge_patch(out[idx], item, field)
    return out


def apply(doc: dict[str, Any], body: Any, content_type: str, custom: bool) -> dict[str, Any]:
    """Apply a PATCH body of `content_type` to `doc` (custom resources refuse strategic merge)."""
    ctype = content_type.split(";")[0].strip().lower()
    if ctype == "application/json-patch+json":
        return json_patch(doc, body)
    if ctype == "application/merge-patch+json":
        if not isinstance(body, dict):
            raise PatchError("a merge patch must be a JSON object", 400)
        return merge_patch(doc, body)
    if ctype == "application/strategic-merge-patch+json":
        if custom:
            raise PatchError("strategic merge patch is not supported for custom resources", 415)
        if not isinstance(body, dict):
            raise PatchError("a strategic merge patch must be a JSON object", 400)
        return strategic_merge_patch(doc, body)
    if ctype == "application/apply-patch+yaml":
        # Server-side apply without field ownership: the applied fields win, lists are replaced.
        if not isinstance(body, dict):
            raise PatchError("an apply patch must be an object", 400)
        return merge_patch(doc, body)
    raise PatchError(f"unsupported patch content type {content_type!r}", 415)
