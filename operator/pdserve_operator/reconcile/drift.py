"""Does a live child still say what we rendered? Pure comparison and the patch that fixes it.

"Still says" means: every field we render has the same value live. Fields we do not render
(server defaults such as `clusterIP` or `imagePullPolicy` inside probes, fields other
controllers own) are not ours and are left alone, which is what server-side apply would do.
Lists are compared item by item with the same rule, so a defaulted field inside a container
does not read as drift, but an edited env value or an extra container does. The API server
omits optional fields that are empty strings or empty collections (Go's `omitempty`), so those
equal "absent" here; a false boolean does not (a `*bool` keeps it), which is why children/
renders no false that a plain `bool` field would drop.
"""

from __future__ import annotations

from typing import Any

# Top-level keys of an object that are not "content": identity and what controllers report.
_NOT_CONTENT = {"apiVersion", "kind", "metadata", "status"}
# Metadata we own on a child; the rest (uid, resourceVersion, managedFields, ...) is the server's.
_OWNED_METADATA = ("labels", "annotations", "ownerReferences")


def _empty(value: Any) -> bool:
    return value is None or value == "" or value == {} or value == []


def _scalar_equal(want: Any, have: Any) -> bool:
    if isinstance(want, bool) or isinstance(have, bool):
        return want is have or want == have and type(want) is type(have)
    if (
        isinstance(want, (int, float))
        and isinstance(have, str)
        or isinstance(have, (int, float))
        and isinstance(want, str)
    ):
        return str(want) == str(have)  # quantities: the API server returns them as strings
    return bool(want == have)


def drifted_paths(want: Any, have: Any, path: str = "") -> list[str]:
    """Paths (dotted, `[i]` for list items) where `have` does not carry `want`."""
    if isinstance(want, dict):
        if _empty(want) and _empty(have):
            return []
        if not isinstance(have, dict):
            return [path or "."]
        out: list[str] = []
        for key, value in want.items():
            sub = f"{path}.{key}" if path else key
            if key not in have:
                if not _empty(value):
                    out.append(sub)
                continue
            out += drifted_paths(value, have[key], sub)
        return out
    if isinstance(want, list):
        if _empty(want) and _empty(have):
            return []
        if not isinstance(have, list) or len(want) != len(have):
            return [path or "."]
        out = []
        for i, (w, h) in enumerate(zip(want, have)):
            out += drifted_paths(w, h, f"{path}[{i}]")
        return out
    if _empty(want) and _empty(have):
        return []
    return [] if _scalar_equal(want, have) else [path or "."]


def content_drift(desired: dict[str, Any], live: dict[str, Any]) -> list[str]:
    """Drift of a child: its owned metadata and its content (spec, data, ...)."""
    paths: list[str] = []
    meta_want = desired.get("metadata", {})
    meta_have = live.get("metadata", {})
    for key in _OWNED_METADATA:
        if key in meta_want:
            paths += drifted_paths(meta_want[key], meta_have.get(key), f"metadata.{key}")
    for key, value in desired.items():
        if key not in _NOT_CONTENT:
            paths += drifted_paths(value, live.get(key), key)
    return paths


def merge_patch(desired: dict[str, Any]) -> dict[str, Any]:
    """A JSON merge patch (RFC 7386) that puts every rendered field back.

    Lists are replaced whole by a merge patch, which is exactly what reverts an edited env list.
    """
    meta = desired.get("metadata", {})
    patch: dict[str, Any] = {"metadata": {k: meta[k] for k in _OWNED_METADATA if k in meta}}
    for key, value in desired.items():
        if key not in _NOT_CONTENT:
            patch[key] = value
    return patch


def foreign_controller(desired: dict[str, Any], live: dict[str, Any]) -> str | None:
    """The uid of another controller owning `live`, if one does (then we must not take it over)."""
    ours = {ref.get("uid") for ref in desired.get("metadata", {}).get("ownerReferences", [])}
    return controller_other_than(ours, live)


def controller_other_than(uids: set[Any], live: dict[str, Any] | None) -> str | None:
    """The uid of `live`'s controller (the ownerReference with `controller: true`) when it is
    none of `uids`; None when `live` has no controller or one of those."""
    for ref in (live or {}).get("metadata", {}).get("ownerReferences", []) or []:
        if ref.get("controller") and ref.get("uid") not in uids:
            return str(ref.get("uid"))
    return None
