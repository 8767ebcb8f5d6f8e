"""Field ownership (`metadata.managedFields`) of Update operations, as the API server records it.

Ported from the API server's field manager (k8s.io/apiserver/pkg/endpoints/handlers/fieldmanager,
whose Update path ends in sigs.k8s.io/structured-merge-diff/v4 merge/update.go `Updater.update`):

- every create, update or patch that is not a server-side apply is an *Update* by one manager:
  the `fieldManager` query parameter, else the User-Agent up to its first "/"
  (`prefixFromUserAgent`);
- the fields it added or modified become its own and stop being any other manager's (an Update
  always "forces"); fields it removed stop being anyone's;
- one entry per (manager, operation, apiVersion, subresource); an entry left without fields goes;
- a write through `/scale` is recorded on the parent's own field (`f:spec.f:replicas`) with
  `subresource: scale` (the scale subresource's field-manager handler), one through `/status`
  with `subresource: status`;
- `fieldsV1` is the set as a trie: `f:<key>` per map key, `{}` for a leaf.

Simplified, and so no evidence about them: lists are atomic (the API server keys the items of
associative lists, `k:{...}`), server-side apply records no ownership here (patching.py), and a
client cannot reset managedFields. Metadata the server owns (uid, resourceVersion, ...) is never
anyone's.
"""

from __future__ import annotations

import copy
from typing import Any

Path = tuple[str, ...]
_SERVER_METADATA = {
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "managedFields",
    "selfLink",
    "name",
    "namespace",
}
_IDENTITY = {"apiVersion", "kind"}


def manager_of(params: dict[str, str], user_agent: str) -> str:
    """The manager of an Update: fieldManager, else prefixFromUserAgent."""
    return params.get("fieldManager") or user_agent.split("/", 1)[0] or "unknown"


def leaves(obj: Any, prefix: Path = ()) -> dict[Path, Any]:
    """Every leaf field of an object (maps are walked, lists and scalars are leaves)."""
    if isinstance(obj, dict) and obj:
        out: dict[Path, Any] = {}
        for key, value in obj.items():
            if not prefix and key in _IDENTITY:
                continue
            if prefix == ("metadata",) and key in _SERVER_METADATA:
                continue
            out.update(leaves(value, (*prefix, key)))
        return out
    return {prefix: obj} if prefix else {}


def to_fields_v1(paths: set[Path]) -> dict[str, Any]:
    trie: dict[str, Any] = {}
    for path in sorted(paths):
        node = trie
        for key in path:
            node = node.setdefault(f"f:{key}", {})
    return trie


def from_fields_v1(trie: dict[str, Any], prefix: Path = ()) -> set[Path]:
    out: set[Path] = set()
    for key, sub in trie.items():
        if not key.startswith("f:"):
            continue
        path = (*prefix, key[2:])
        out |= from_fields_v1(sub, path) if sub else {path}
    return out


def record_update(
    old: dict[str, Any] | None, new: dict[str, Any], manager: str, subresource: str | None, now: str
) -> None:
    """Set `new`'s managedFields after an Update by `manager` that turned `old` into `new`."""
    before = leaves({k: v for k, v in (old or {}).items() if subresource == "status" or k != "status"})
    after = leaves({k: v for k, v in new.items() if subresource == "status" or k != "status"})
    if subresource == "status":
        before = {p: v for p, v in before.items() if p[0] == "status"}
        after = {p: v for p, v in after.items() if p[0] == "status"}
    changed = {p for p, v in after.items() if p not in before or before[p] != v}
    removed = set(before) - set(after)
    api_version = new.get("apiVersion", "")
    entries: list[dict[str, Any]] = []
    mine: set[Path] = set(changed)
    for entry in copy.deepcopy((old or {}).get("metadata", {}).get("managedFields") or []):
        fields = from_fields_v1(entry.get("fieldsV1") or {})
        if (entry.get("manager"), entry.get("operation"), entry.get("apiVersion"), entry.get("subresource")) == (
            manager,
            "Update",
            api_version,
            subresource,
        ):
            mine |= fields - removed
            continue
        fields -= changed | removed
        # A field whose ancestor or descendant changed hands as a whole goes with it.
        fields = {f for f in fields if not any(f[: len(c)] == c or c[: len(f)] == f for c in changed | removed)}
        if fields:
            entry["fieldsV1"] = to_fields_v1(fields)
            entries.append(entry)
    if mine:
        entry = {
            "manager": manager,
            "operation": "Update",
            "apiVersion": api_version,
            "time": now,
            "fieldsType": "FieldsV1",
            "fieldsV1": to_fields_v1(mine),
        }
        if subresource:
            entry["subresource"] = subresource
        entries.append(entry)
    meta = new.setdefault("metadata", {})
    if entries:
        meta["managedFields"] = entries
    else:
        meta.pop("managedFields", None)


def owners(obj: dict[str, Any], path: Path) -> list[str]:
    """The managers that own `path` of `obj` (a test's question)."""
    return [
        e["manager"]
        for e in (obj.get("metadata", {}).get("managedFields") or [])
        if path in from_fields_v1(e.get("fieldsV1") or {})
    ]
