"""Label and field selectors as the API server parses them (`a=b,c!=d,e in (x,y),!f`)."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

Predicate = Callable[[Mapping[str, str]], bool]

_SET = re.compile(r"^\s*([^\s!=,()]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")
_EQ = re.compile(r"^\s*([^\s!=,()]+)\s*(==|=|!=)\s*([^\s,()]*)\s*$")
_EXISTS = re.compile(r"^\s*(!?)\s*([^\s!=,()]+)\s*$")


class SelectorError(ValueError):
    pass


def _split(selector: str) -> list[str]:
    """Split on commas outside parentheses."""
    parts, depth, cur = [], 0, ""
    for ch in selector:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur)
    return [p for p in parts if p.strip()]


def _term(text: str) -> Predicate:
    if m := _SET.match(text):
        key, op, values = m.group(1), m.group(2), {v.strip() for v in m.group(3).split(",") if v.strip()}
        if op == "in":
            return lambda labels: labels.get(key) in values
        return lambda labels: labels.get(key) not in values
    if m := _EQ.match(text):
        key, op, value = m.groups()
        if op == "!=":
            return lambda labels: labels.get(key) != value
        return lambda labels: labels.get(key) == value
    if m := _EXISTS.match(text):
        neg, key = m.groups()
        return (lambda labels: key not in labels) if neg else (lambda labels: key in labels)
    raise SelectorError(f"unable to parse requirement: {text!r}")


def parse_labels(selector: str | None) -> Predicate:
    if not selector:
        return lambda labels: True
    terms = [_term(p) for p in _split(selector)]
    return lambda labels: all(t(labels) for t in terms)


def _dig(obj: Mapping[str, Any], path: str) -> str | None:
    cur: Any = obj
    for part in path.split("."):
        if not isinstance(cur, Mapping):
            return None
        cur = cur.get(part)
    return None if cur is None else str(cur)


def parse_fields(selector: str | None) -> Callable[[Mapping[str, Any]], bool]:
    """Field selectors: `path=value` / `path!=value` on dotted paths of the object."""
    if not selector:
        return lambda obj: True
    checks = []
    for part in _split(selector):
        m = _EQ.match(part)
        if not m:
            raise SelectorError(f"invalid field selector: {part!r}")
        checks.append(m.groups())

    def match(obj: Mapping[str, Any]) -> bool:
        for path, op, value in checks:
            have = _dig(obj, path) or ""
            if (have == value) != (op != "!="):
                return False
        return True

    return match
