"""What `promtool check rules` checks, ported, and the series a PromQL expression reads.

promtool cannot be installed here (no package ships it), so `rule_file_errors` ports
prometheus/prometheus `model/rulefmt/rulefmt.go` (commit 01bfd185): `Parse` decodes with
`KnownFields(true)` (an unknown key is an error), `RuleGroups.Validate` (group name set and
unique in the file, group label names and values valid) and `Rule.Validate` (exactly one of
record/alert, expr set and parsed by the PromQL parser, no annotations/for/keep_firing_for on a
recording rule, a recording rule's name a valid metric name without braces, label and
annotation names valid), plus `model.Duration`'s syntax for interval/for/keep_firing_for.
Expressions are parsed by `promql_parser` (PyPI, Python bindings of GreptimeTeam's Rust port of
the Prometheus parser). `testTemplateParsing` runs Go's text/template parser on labels and
annotations; there is no Go template parser on PyPI, so `_template_errors` checks only what
catches the usual mistakes: balanced `{{ }}` and variables that the alert template defines
(`$labels`, `$value`, `$externalLabels`, `$externalURL`). Names follow the legacy
(pre-UTF-8) validation scheme, the stricter one.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import promql_parser

LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")  # model.LabelNameRE, legacy scheme
METRIC_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")  # model.MetricNameRE, legacy scheme
# prometheus/common model.ParseDuration: units from largest to smallest, each at most once.
DURATION = re.compile(r"^(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?$")
GROUP_KEYS = {"name", "interval", "query_offset", "limit", "rules", "labels"}
RULE_KEYS = {"record", "alert", "expr", "for", "keep_firing_for", "labels", "annotations"}
TEMPLATE_VARS = {"$labels", "$value", "$externalLabels", "$externalURL"}


def _duration_error(value: Any) -> str | None:
    if not isinstance(value, str) or not value or (value != "0" and not DURATION.match(value)):
        return f"not a valid duration string: {value!r}"
    return None


def _template_errors(text: str) -> list[str]:
    errors = []
    depth = 0
    i = 0
    while i < len(text):
        if text.startswith("{{", i):
            if depth:
                errors.append(f"unexpected '{{{{' inside an action in {text!r}")
            depth += 1
            end = text.find("}}", i + 2)
            if end < 0:
                errors.append(f"unclosed action in {text!r}")
                break
            action = text[i + 2 : end]
            defined = set(re.findall(r"(\$[A-Za-z_][A-Za-z0-9_]*)\s*:?=", action))
            for var in re.findall(r"\$[A-Za-z_][A-Za-z0-9_]*", action):
                if var not in TEMPLATE_VARS and var not in defined:
                    errors.append(f"undefined variable {var!r} in {text!r}")
            depth -= 1
            i = end + 2
            continue
        if text.startswith("}}", i):
            errors.append(f"unexpected '}}}}' in {text!r}")
        i += 1
    return errors


def _labels_errors(labels: Any, what: str) -> list[str]:
    if labels is None:
        return []
    if not isinstance(labels, dict):
        return [f"{what}: labels must be a map, got {labels!r}"]
    errors = []
    for k, v in labels.items():
        if not isinstance(k, str) or not LABEL_NAME.match(k) or k == "__name__":
            errors.append(f"{what}: invalid label name: {k}")
        if not isinstance(v, str):
            errors.append(f"{what}: invalid label value: {v!r}")
    return errors


def rule_file_errors(doc: Any) -> list[str]:
    """Every error `promtool check rules` would report for a rule file `{groups: [...]}`."""
    if not isinstance(doc, dict) or set(doc) - {"groups"}:
        return [f"a rule file is a map with only 'groups', got keys {sorted(doc) if isinstance(doc, dict) else doc!r}"]
    errors: list[str] = []
    seen: set[str] = set()
    for j, group in enumerate(doc.get("groups") or []):
        if not isinstance(group, dict):
            errors.append(f"group {j}: not a map")
            continue
        unknown = set(group) - GROUP_KEYS
        if unknown:
            errors.append(f"group {j}: field {sorted(unknown)[0]} not found in type rulefmt.RuleGroup")
        name = group.get("name") or ""
        if name == "":
            errors.append(f"group {j}: Groupname must not be empty")
        if name in seen:
            errors.append(f'groupname: "{name}" is repeated in the same file')
        seen.add(name)
        errors += _labels_errors(group.get("labels"), f"group {name!r}")
        for key in ("interval", "query_offset"):
            if key in group and (e := _duration_error(group[key])):
                errors.append(f"group {name!r}: {key}: {e}")
        for i, rule in enumerate(group.get("rules") or [], start=1):
            errors += [f'group "{name}", rule {i}: {e}' for e in rule_errors(rule)]
    return errors


def rule_errors(rule: Any) -> list[str]:
    """`Rule.Validate` for one rule (and the decoder's strictness about its keys)."""
    if not isinstance(rule, dict):
        return [f"a rule is a map, got {rule!r}"]
    errors = [f"field {k} not found in type rulefmt.Rule" for k in sorted(set(rule) - RULE_KEYS)]
    record, alert, expr = rule.get("record", ""), rule.get("alert", ""), rule.get("expr", "")
    if record and alert:
        errors.append("only one of 'record' and 'alert' must be set")
    if not record and not alert:
        errors.append("one of 'record' or 'alert' must be set")
    if not expr:
        errors.append("field 'expr' must be set in rule")
    else:
        try:
            promql_parser.parse(expr)
        except ValueError as exc:
            errors.append(f"could not parse expression: {exc}")
    for key in ("for", "keep_firing_for"):
        if key in rule and (e := _duration_error(rule[key])):
            errors.append(f"{key}: {e}")
    if record:
        if rule.get("annotations"):
            errors.append("invalid field 'annotations' in recording rule")
        if rule.get("for") not in (None, "0", "0s"):
            errors.append("invalid field 'for' in recording rule")
        if rule.get("keep_firing_for") not in (None, "0", "0s"):
            errors.append("invalid field 'keep_firing_for' in recording rule")
        if not METRIC_NAME.match(record):
            errors.append(f"invalid recording rule name: {record}")
        if "{" in record or "}" in record:
            errors.append(f"braces present in the recording rule name; should it be in expr?: {record}")
    errors += _labels_errors(rule.get("labels"), "rule")
    for k in rule.get("annotations") or {}:
        if not LABEL_NAME.match(str(k)):
            errors.append(f"invalid annotation name: {k}")
    if alert:  # testTemplateParsing: alerting rules only
        for kind in ("labels", "annotations"):
            for k, v in (rule.get(kind) or {}).items():
                errors += [f"{kind[:-1]} {k!r}: {e}" for e in _template_errors(str(v))]
    return errors


# ---- the series an expression reads ----------------------------------------------------------


@dataclass
class Selector:
    metric: str
    matchers: dict[str, list[tuple[str, str]]] = field(default_factory=dict)  # label -> [(op, value)]


@dataclass
class ExprUse:
    selectors: list[Selector]
    grouping: set[str]  # labels named in by/without/on/ignoring/group_left/group_right


def uses(expr: str) -> ExprUse:
    """The selectors and grouping labels of a PromQL expression (raises ValueError if it does not parse)."""
    tree = promql_parser.parse(expr)
    selectors: list[Selector] = []
    grouping: set[str] = set()

    def visit(node: Any) -> None:
        kind = type(node).__name__
        if kind == "VectorSelector":
            sel = Selector(node.name or "")
            for m in node.matchers.matchers:
                if m.name == "__name__":
                    sel.metric = m.value
                    continue
                sel.matchers.setdefault(m.name, []).append((str(m.op).rsplit(".", 1)[-1], m.value))
            selectors.append(sel)
        elif kind == "AggregateExpr" and node.modifier is not None:
            grouping.update(node.modifier.labels)
        elif kind == "BinaryExpr" and node.modifier is not None:
            if node.modifier.matching is not None:
                grouping.update(node.modifier.matching.labels)
            grouping.update(node.modifier.group_labels or [])

    promql_parser.walk(tree, visit)
    return ExprUse(selectors, grouping)


def grafana_expr(expr: str, variables: Iterable[str]) -> str:
    """A Grafana target's expr as Prometheus receives it: `$__rate_interval` a duration, every
    dashboard variable (used inside a regex matcher) a regex."""
    out = expr.replace("$__rate_interval", "5m").replace("$__interval", "1m").replace("$__range", "1h")
    for var in sorted(variables, key=len, reverse=True):
        out = out.replace(f"${{{var}}}", ".*").replace(f"${var}", ".*")
    if "$" in out:
        raise ValueError(f"an unknown variable is left in {expr!r}: {out!r}")
    return out
