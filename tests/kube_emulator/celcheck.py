"""Compile an `x-kubernetes-validations` rule against its schema, as the API server does.

Upstream (kubernetes/apiextensions-apiserver at 1aa2717a552ee6ca1e2a18f1f8ffccde981db923,
`pkg/apiserver/schema/cel/compilation.go` `Compile`/`compileRule`) parses and *type-checks* each
rule with cel-go against a declared type of `self` derived from the schema
(k8s.io/apiserver `pkg/cel/common/schemas.go` `SchemaDeclType`), then refuses a rule whose output
type is not bool. So `self.spec.replicsa > 0` is refused when the CRD is created ("undefined field
'replicsa'"), not when the first object arrives.

cel-python (celpy) parses CEL with the grammar of the CEL spec but has no type checker, so the
parse tree celpy produces is checked here: declared types from the schema (`decl_type`, the port
of `SchemaDeclType`, including the root's `apiVersion`, `kind`, `metadata.name/generateName` of
`WithTypeAndObjectMeta`), field selection and `has()` on declared objects, comprehension macros,
the operators' operand types, and the bool result. Errors print the way cel-go prints its issues
(`ERROR: <input>:LINE:COL: message` plus the source line and a caret), prefixed with
"compilation failed: " as compileRule does.

Bounded on purpose, and lenient where unsure: the return and argument types of most of the
Kubernetes CEL library (strings, lists, regex, URLs, IPs, quantities, semver, optionals...) are
not modelled and yield `dyn`, but a receiver function whose *name* is in no library of the
environment (`MEMBER_FUNCTIONS`) is refused as cel-go refuses it; numeric operands of different
kinds are not refused; syntax errors carry celpy's (lark's) wording instead of ANTLR's. Cost
estimation is not ported.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Any

import lark
from celpy.celparser import CELParseError, CELParser

Schema = dict[str, Any]

# ---------------------------------------------------------------- types


@dataclass(frozen=True)
class T:
    """A CEL type: kind plus element/key/value types, or the fields of an object type."""

    kind: str  # bool int uint double string bytes null_type timestamp duration dyn list map object type optional
    elem: T | None = None
    key: T | None = None
    fields: tuple[tuple[str, T], ...] = ()

    def field(self, name: str) -> T | None:
        return dict(self.fields).get(name)

    def __str__(self) -> str:
        names = {"timestamp": "google.protobuf.Timestamp", "duration": "google.protobuf.Duration"}
        if self.kind == "list":
            return f"list({self.elem})"
        if self.kind == "map":
            return f"map({self.key}, {self.elem})"
        if self.kind == "optional":
            return f"optional_type({self.elem})"
        return names.get(self.kind, self.kind)


BOOL, INT, UINT, DOUBLE, STRING, BYTES = T("bool"), T("int"), T("uint"), T("double"), T("string"), T("bytes")
NULL, DYN, TYPE, TIMESTAMP, DURATION = T("null_type"), T("dyn"), T("type"), T("timestamp"), T("duration")
NUMERIC = {"int", "uint", "double"}


def list_of(elem: T) -> T:
    return T("list", elem=elem)


def map_of(key: T, value: T) -> T:
    return T("map", elem=value, key=key)


_CEL_RESERVED = {
    "true",
    "false",
    "null",
    "in",
    "as",
    "break",
    "const",
    "continue",
    "else",
    "for",
    "function",
    "if",
    "import",
    "let",
    "loop",
    "package",
    "namespace",
    "return",
    "var",
    "void",
    "while",
}


def escape(name: str) -> str | None:
    """`apiservercel.Escape`: property names CEL can address (`-` `.` `/` and keywords escaped)."""
    if name in _CEL_RESERVED:
        return f"__{name}__"
    if not name or not (name[0].isalpha() or name[0] == "_"):
        return None
    out = (
        name.replace("__", "__underscores__").replace(".", "__dot__").replace("-", "__dash__").replace("/", "__slash__")
    )
    return out if re.fullmatch(r"[_a-zA-Z][_a-zA-Z0-9]*", out) else None


def decl_type(s: Schema | None, resource_root: bool = False) -> T | None:
    """`SchemaDeclType`: the CEL type of values conforming to schema `s` (None: not addressable)."""
    if s is None:
        return None
    if s.get("x-kubernetes-int-or-string") is True:
        return DYN
    if resource_root:
        s = with_type_and_object_meta(s)
    kind = s.get("type")
    if kind == "array":
        items = s.get("items")
        if isinstance(items, dict):
            elem = decl_type(items, items.get("x-kubernetes-embedded-resource") is True)
            return list_of(elem) if elem is not None else None
        return None
    if kind == "object":
        extra = s.get("additionalProperties")
        if isinstance(extra, dict):
            value = decl_type(extra, extra.get("x-kubernetes-embedded-resource") is True)
            return map_of(STRING, value) if value is not None else None
        fields = []
        for name, prop in sorted((s.get("properties") or {}).items()):
            ftype = decl_type(prop, prop.get("x-kubernetes-embedded-resource") is True)
            escaped = escape(name)
            if ftype is not None and escaped is not None:
                fields.append((escaped, ftype))
        return T("object", fields=tuple(fields))
    if kind == "string":
        return {"byte": BYTES, "duration": DURATION, "date": TIMESTAMP, "date-time": TIMESTAMP}.get(
            s.get("format") or "", STRING
        )
    return {"boolean": BOOL, "number": DOUBLE, "integer": INT}.get(kind or "")


def with_type_and_object_meta(s: Schema) -> Schema:
    """`WithTypeAndObjectMeta`: at a resource root, apiVersion, kind, metadata.name and
    metadata.generateName are always declared (and nothing else of metadata)."""
    props = dict(s.get("properties") or {})
    props["apiVersion"] = {"type": "string"}
    props["kind"] = {"type": "string"}
    props["metadata"] = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "generateName": {"type": "string"}},
    }
    return {**s, "type": "object", "properties": props}


# Every receiver-style function (and macro) of the CEL environment the API server compiles rules in
# (k8s.io/apiserver pkg/cel/environment/base.go): cel-go's standard library and optionals
# (cel/library.go), ext.Strings v2, ext.Lists v3, two-variable comprehensions (ext/*.go at
# cel-go 14f6746a), and the Kubernetes libraries (pkg/cel/library/library_compatibility_test.go's
# knownFunctions, kubernetes/apiserver 24a394e5). A name outside this set is a typo to cel-go.
MEMBER_FUNCTIONS = frozenset(
    {
        # cel-go standard and optionals
        "contains",
        "endsWith",
        "startsWith",
        "matches",
        "size",
        "getDate",
        "getDayOfMonth",
        "getDayOfWeek",
        "getDayOfYear",
        "getFullYear",
        "getHours",
        "getMilliseconds",
        "getMinutes",
        "getMonth",
        "getSeconds",
        "hasValue",
        "value",
        "or",
        "orValue",
        "optMap",
        "optFlatMap",
        "first",
        "last",
        # macros
        "all",
        "exists",
        "exists_one",
        "existsOne",
        "map",
        "filter",
        "sortBy",
        "transformList",
        "transformMap",
        "transformMapEntry",
        # ext.Strings, ext.Lists
        "charAt",
        "format",
        "indexOf",
        "join",
        "lastIndexOf",
        "lowerAscii",
        "replace",
        "reverse",
        "split",
        "substring",
        "trim",
        "upperAscii",
        "distinct",
        "flatten",
        "slice",
        "sort",
        # Kubernetes libraries
        "isSorted",
        "sum",
        "max",
        "min",
        "find",
        "findAll",
        "getScheme",
        "getHost",
        "getHostname",
        "getPort",
        "getEscapedPath",
        "getQuery",
        "path",
        "group",
        "serviceAccount",
        "resource",
        "subresource",
        "namespace",
        "name",
        "check",
        "allowed",
        "reason",
        "errored",
        "error",
        "add",
        "asApproximateFloat",
        "asInteger",
        "compareTo",
        "isGreaterThan",
        "isInteger",
        "isLessThan",
        "sign",
        "sub",
        "ip",
        "family",
        "isUnspecified",
        "isLoopback",
        "isLinkLocalMulticast",
        "isLinkLocalUnicast",
        "isGlobalUnicast",
        "isCanonical",
        "containsIP",
        "containsCIDR",
        "masked",
        "prefixLength",
        "string",
        "fieldSelector",
        "labelSelector",
        "validate",
        "major",
        "minor",
        "patch",
        "includes",
    }
)

# ---------------------------------------------------------------- compilation


@dataclass
class Compiled:
    """What compileRule records: an error (compilation failed / not bool) and whether oldSelf is used."""

    error: str | None = None
    uses_old_self: bool = False


@dataclass
class _Issue:
    offset: int
    message: str


@dataclass
class _Checker:
    source: str
    self_type: T
    old_self_optional: bool = False
    issues: list[_Issue] = field(default_factory=list)
    uses_old_self: bool = False

    # -- helpers
    def error(self, offset: int, message: str) -> T:
        self.issues.append(_Issue(offset, message))
        return DYN

    def dot_before(self, token: lark.Token) -> int:
        i = token.start_pos - 1
        while i > 0 and self.source[i].isspace():
            i -= 1
        return i

    def op_between(self, left: Any, right: Any, op: str) -> int:
        start = getattr(getattr(left, "meta", None), "end_pos", 0) or 0
        end = getattr(getattr(right, "meta", None), "start_pos", len(self.source)) or len(self.source)
        found = self.source.find(op, start, end)
        return found if found >= 0 else start

    def open_paren(self, name_tok: lark.Token) -> int:
        """Where cel-go locates a call: its "(" (parser.go VisitMemberCall/VisitGlobalCall use the op token)."""
        found = self.source.find("(", name_tok.end_pos or 0)
        return found if found >= 0 else (name_tok.start_pos or 0)

    def start(self, node: Any) -> int:
        if isinstance(node, lark.Token):
            return node.start_pos or 0
        return getattr(node.meta, "start_pos", 0) or 0

    # -- the walk: one method per grammar rule of celpy's cel.lark
    def check(self, node: Any, env: dict[str, T]) -> T:
        return getattr(self, f"_{node.data}")(node, env)

    def _expr(self, node: lark.Tree, env: dict[str, T]) -> T:
        if len(node.children) == 1:
            return self.check(node.children[0], env)
        cond, then, other = node.children
        ctype = self.check(cond, env)
        if ctype.kind not in ("bool", "dyn"):
            self.error(
                self.op_between(cond, then, "?"), f"found no matching overload for '_?_:_' applied to '({ctype}, ...)'"
            )
        a, b = self.check(then, env), self.check(other, env)
        return a if a == b else DYN

    def _logical(self, node: lark.Tree, env: dict[str, T], op: str) -> T:
        if len(node.children) == 1:
            return self.check(node.children[0], env)
        left, right = node.children
        a, b = self.check(left, env), self.check(right, env)
        if a.kind not in ("bool", "dyn") or b.kind not in ("bool", "dyn"):
            self.error(
                self.op_between(left, right, op), f"found no matching overload for '_{op}_' applied to '({a}, {b})'"
            )
        return BOOL

    def _conditionalor(self, node: lark.Tree, env: dict[str, T]) -> T:
        return self._logical(node, env, "||")

    def _conditionaland(self, node: lark.Tree, env: dict[str, T]) -> T:
        return self._logical(node, env, "&&")

    def _relation(self, node: lark.Tree, env: dict[str, T]) -> T:
        if len(node.children) == 1:
            return self.check(node.children[0], env)
        op_node, right = node.children
        op = {
            "relation_lt": "<",
            "relation_le": "<=",
            "relation_gt": ">",
            "relation_ge": ">=",
            "relation_eq": "==",
            "relation_ne": "!=",
            "relation_in": "in",
        }[op_node.data]
        left = op_node.children[0]
        a, b = self.check(left, env), self.check(right, env)
        where = self.op_between(left, right, op)
        if op == "in":
            # cel-go's overloads: (A, list(A)) and (A, map(A, B))
            member = b.elem if b.kind == "list" else b.key if b.kind == "map" else None
            if b.kind not in ("list", "map", "dyn") or member is not None and _incomparable(a, member):
                self.error(where, f"found no matching overload for '@in' applied to '({a}, {b})'")
            return BOOL
        if _incomparable(a, b):
            name = {"<": "_<_", "<=": "_<=_", ">": "_>_", ">=": "_>=_", "==": "_==_", "!=": "_!=_"}[op]
            self.error(where, f"found no matching overload for '{name}' applied to '({a}, {b})'")
        return BOOL

    def _arith(self, node: lark.Tree, env: dict[str, T]) -> T:
        if len(node.children) == 1:
            return self.check(node.children[0], env)
        op_node, right = node.children
        a, b = self.check(op_node.children[0], env), self.check(right, env)
        return a if a == b and a.kind != "dyn" else DYN

    _addition = _arith
    _multiplication = _arith

    def _unary(self, node: lark.Tree, env: dict[str, T]) -> T:
        if len(node.children) == 1:
            return self.check(node.children[0], env)
        op, operand = node.children
        t = self.check(operand, env)
        if op.data == "unary_not":
            if t.kind not in ("bool", "dyn"):
                self.error(self.start(node), f"found no matching overload for '!_' applied to '({t})'")
            return BOOL
        return t

    def _member(self, node: lark.Tree, env: dict[str, T]) -> T:
        return self.check(node.children[0], env)

    def _primary(self, node: lark.Tree, env: dict[str, T]) -> T:
        return self.check(node.children[0], env)

    def _paren_expr(self, node: lark.Tree, env: dict[str, T]) -> T:
        return self.check(node.children[0], env)

    def _literal(self, node: lark.Tree, env: dict[str, T]) -> T:
        tok = node.children[0]
        return {
            "UINT_LIT": UINT,
            "FLOAT_LIT": DOUBLE,
            "INT_LIT": INT,
            "MLSTRING_LIT": STRING,
            "STRING_LIT": STRING,
            "BYTES_LIT": BYTES,
            "BOOL_LIT": BOOL,
            "NULL_LIT": NULL,
        }[tok.type]

    def _list_lit(self, node: lark.Tree, env: dict[str, T]) -> T:
        elems = [self.check(e, env) for e in (node.children[0].children if node.children and node.children[0] else [])]
        return list_of(elems[0] if elems and all(e == elems[0] for e in elems) else DYN)

    def _map_lit(self, node: lark.Tree, env: dict[str, T]) -> T:
        inits = node.children[0].children if node.children and node.children[0] else []
        keys = [self.check(k, env) for k in inits[0::2]]
        values = [self.check(v, env) for v in inits[1::2]]
        key = keys[0] if keys and all(k == keys[0] for k in keys) else DYN
        value = values[0] if values and all(v == values[0] for v in values) else DYN
        return map_of(key, value)

    def _ident(self, node: lark.Tree, env: dict[str, T]) -> T:
        tok = node.children[0]
        name = str(tok)
        if name == "oldSelf" and "oldSelf" in env:
            self.uses_old_self = True
        if name in env:
            return env[name]
        if name in ("int", "uint", "double", "string", "bytes", "bool", "list", "map", "null_type", "type", "dyn"):
            return TYPE
        return self.error(tok.start_pos, f"undeclared reference to '{name}' (in container '')")

    def select(self, operand: T, name: str, offset: int) -> T:
        if operand.kind == "object":
            found = operand.field(name)
            return found if found is not None else self.error(offset, f"undefined field '{name}'")
        if operand.kind == "map":
            return operand.elem or DYN
        if operand.kind == "dyn":
            return DYN
        if operand.kind == "optional":
            inner = self.select(operand.elem or DYN, name, offset)
            return T("optional", elem=inner)
        return self.error(offset, f"type '{operand}' does not support field selection")

    def _member_dot(self, node: lark.Tree, env: dict[str, T]) -> T:
        operand_node, ident = node.children
        if _namespace(operand_node):
            return DYN
        operand = self.check(operand_node, env)
        return self.select(operand, str(ident), self.dot_before(ident))

    def _member_index(self, node: lark.Tree, env: dict[str, T]) -> T:
        operand_node, index_node = node.children
        operand, index = self.check(operand_node, env), self.check(index_node, env)
        if operand.kind == "list":
            if index.kind not in ("int", "uint", "dyn"):
                self.error(
                    self.start(index_node), f"found no matching overload for '_[_]' applied to '({operand}, {index})'"
                )
            return operand.elem or DYN
        if operand.kind == "map":
            return operand.elem or DYN
        if operand.kind == "object" and index.kind == "string":
            return DYN
        if operand.kind == "dyn":
            return DYN
        return self.error(
            self.start(index_node), f"found no matching overload for '_[_]' applied to '({operand}, {index})'"
        )

    def _member_object(self, node: lark.Tree, env: dict[str, T]) -> T:
        return self.error(self.start(node), "object construction is not supported in validation rules")

    def _args(self, node: lark.Tree | None) -> list[Any]:
        return list(node.children) if node is not None else []

    def _ident_arg(self, node: lark.Tree, env: dict[str, T]) -> T:
        name_tok, args_node = node.children[0], (node.children[1] if len(node.children) > 1 else None)
        name, args = str(name_tok), self._args(args_node)
        if name == "has":
            return self.has(args, name_tok, env)
        types = [self.check(a, env) for a in args]
        if name == "size":
            if len(types) == 1 and types[0].kind not in ("string", "bytes", "list", "map", "dyn"):
                self.error(name_tok.start_pos, f"found no matching overload for 'size' applied to '({types[0]})'")
            return INT
        conversions = {
            "int": INT,
            "uint": UINT,
            "double": DOUBLE,
            "string": STRING,
            "bytes": BYTES,
            "bool": BOOL,
            "timestamp": TIMESTAMP,
            "duration": DURATION,
            "type": TYPE,
            "dyn": DYN,
        }
        if name in conversions:
            return conversions[name]
        if name == "matches" or name.startswith("is") and name[2:3].isupper():
            return BOOL  # matches(s, re), isQuantity, isURL, isIP, isCIDR, isSemver
        if name in ("quantity", "url", "ip", "cidr", "semver", "format"):
            return DYN
        return self.error(name_tok.start_pos, f"undeclared reference to '{name}' (in container '')")

    def has(self, args: list[Any], tok: lark.Token, env: dict[str, T]) -> T:
        target = _unwrap(args[0]) if len(args) == 1 else None
        if target is None or target.data != "member_dot":
            return self.error(tok.start_pos, "invalid argument to has() macro")
        self.check(target, env)
        return BOOL

    def _member_dot_arg(self, node: lark.Tree, env: dict[str, T]) -> T:
        operand_node, name_tok = node.children[0], node.children[1]
        args = self._args(node.children[2] if len(node.children) > 2 else None)
        name = str(name_tok)
        if _namespace(operand_node):  # optional.of(), optional.none(), math.least(), strings.quote(), ...
            for a in args:
                self.check(a, env)
            return T("optional", elem=DYN) if str(_namespace(operand_node)) == "optional" else DYN
        operand = self.check(operand_node, env)
        if name in ("all", "exists", "exists_one", "map", "filter") and len(args) in (2, 3):
            return self.comprehension(name, operand, args, env, name_tok)
        types = [self.check(a, env) for a in args]
        if name in (
            "startsWith",
            "endsWith",
            "contains",
            "matches",
            "isSorted",
            "hasValue",
            "isLessThan",
            "isGreaterThan",
            "isInteger",
            "containsIP",
            "containsCIDR",
            "isCanonical",
            "isLoopback",
            "isUnspecified",
            "isGlobalUnicast",
            "isLinkLocalMulticast",
            "isLinkLocalUnicast",
        ):
            return BOOL
        if name == "size":
            return INT
        if name in (
            "indexOf",
            "lastIndexOf",
            "compareTo",
            "sign",
            "asInteger",
            "getMilliseconds",
            "getSeconds",
            "getMinutes",
            "getHours",
            "getFullYear",
            "getMonth",
            "getDate",
            "getDayOfMonth",
            "getDayOfWeek",
            "getDayOfYear",
            "prefixLength",
            "family",
            "major",
            "minor",
            "patch",
        ):
            return INT
        if name in (
            "lowerAscii",
            "upperAscii",
            "trim",
            "replace",
            "substring",
            "charAt",
            "format",
            "reverse",
            "join",
            "find",
            "getScheme",
            "getHost",
            "getHostname",
            "getPort",
            "getEscapedPath",
            "quote",
        ):
            return STRING
        if name in ("split", "findAll"):
            return list_of(STRING)
        if name == "asApproximateFloat":
            return DOUBLE
        if name in ("value", "orValue"):
            return operand.elem if operand.kind == "optional" and operand.elem else (types[0] if types else DYN)
        if name in ("sum", "min", "max") and operand.kind == "list":
            return operand.elem or DYN
        if name not in MEMBER_FUNCTIONS:
            return self.error(self.open_paren(name_tok), f"undeclared reference to '{name}' (in container '')")
        return DYN  # the rest of the Kubernetes CEL library: types not modelled

    def comprehension(self, name: str, operand: T, args: list[Any], env: dict[str, T], tok: lark.Token) -> T:
        var = _unwrap(args[0])
        if var is None or var.data != "ident":
            return self.error(self.start(args[0]), "argument must be a simple name")
        if operand.kind == "list":
            var_type = operand.elem or DYN
        elif operand.kind == "map":
            var_type = operand.key or DYN
        elif operand.kind == "dyn":
            var_type = DYN
        else:
            return self.error(
                tok.start_pos,
                f"expression of type '{operand}' cannot be range of a comprehension (must be list, map, or dynamic)",
            )
        inner = {**env, str(var.children[0]): var_type}
        types = [self.check(a, inner) for a in args[1:]]
        if name in ("all", "exists", "exists_one", "filter"):
            if types[0].kind not in ("bool", "dyn"):
                self.error(
                    self.start(args[1]), f"found no matching overload for '_&&_' applied to '(bool, {types[0]})'"
                )
            return list_of(var_type) if name == "filter" else BOOL
        return list_of(types[-1])


def _unwrap(node: Any) -> lark.Tree | None:
    """Descend single-child wrappers (expr -> conditionalor -> ... -> member -> X) to X."""
    while (
        isinstance(node, lark.Tree)
        and node.data
        in (
            "expr",
            "conditionalor",
            "conditionaland",
            "relation",
            "addition",
            "multiplication",
            "unary",
            "member",
            "primary",
        )
        and len(node.children) == 1
    ):
        node = node.children[0]
    return node if isinstance(node, lark.Tree) else None


def _namespace(node: Any) -> str | None:
    inner = _unwrap(node)
    if (
        inner is not None
        and inner.data == "ident"
        and str(inner.children[0]) in ("optional", "math", "strings", "sets", "lists", "base64")
    ):
        return str(inner.children[0])
    return None


def _incomparable(a: T, b: T) -> bool:
    if "dyn" in (a.kind, b.kind) or "null_type" in (a.kind, b.kind):
        return False
    if a.kind in NUMERIC and b.kind in NUMERIC:
        return False
    simple = {"bool", "int", "uint", "double", "string", "bytes", "timestamp", "duration"}
    return (a.kind in simple or b.kind in simple) and a.kind != b.kind


@functools.lru_cache(maxsize=1)
def _parser() -> CELParser:
    return CELParser()


def _display(source: str, offset: int, message: str) -> str:
    """cel-go's `Error.ToDisplayString`: location (column + 1), the source line, a caret."""
    line_no = source.count("\n", 0, offset) + 1
    line_start = source.rfind("\n", 0, offset) + 1
    col = offset - line_start
    line_end = source.find("\n", offset)
    snippet = source[line_start : len(source) if line_end < 0 else line_end].replace("\t", " ")
    return f"ERROR: <input>:{line_no}:{col + 1}: {message}\n | {snippet}\n | {'.' * col}^"


def compile_rule(rule: str, self_type: T | None, optional_old_self: bool = False) -> Compiled:
    """`compileRule`: parse, type-check against `self`/`oldSelf`, demand a bool result."""
    if not rule.strip():
        return Compiled()
    if self_type is None:
        return Compiled(error="failed to convert to declType for CEL validation rules")
    try:
        tree = _parser().parse(rule)
    except (CELParseError, lark.exceptions.LarkError) as exc:
        offset = 0
        line, column = getattr(exc, "line", None), getattr(exc, "column", None)
        if isinstance(line, int) and isinstance(column, int) and line > 0:
            lines = rule.split("\n")
            offset = sum(len(x) + 1 for x in lines[: line - 1]) + max(column - 1, 0)
        detail = str(exc.args[0] if exc.args else exc).strip().splitlines()[0]
        return Compiled(
            error="compilation failed: " + _display(rule, min(offset, len(rule)), f"Syntax error: {detail}")
        )
    old = T("optional", elem=self_type) if optional_old_self else self_type
    checker = _Checker(rule, self_type, optional_old_self)
    out = checker.check(tree, {"self": self_type, "oldSelf": old})
    if checker.issues:
        text = "\n".join(_display(rule, i.offset, i.message) for i in checker.issues)
        return Compiled(error="compilation failed: " + text, uses_old_self=checker.uses_old_self)
    if out != BOOL:
        return Compiled(error="cel expression must evaluate to a bool", uses_old_self=checker.uses_old_self)
    return Compiled(uses_old_self=checker.uses_old_self)


# ---------------------------------------------------------------- field paths (cel/validation.go)


class FieldPathError(ValueError):
    pass


def valid_field_path(
    json_path: str, schema: Schema, allow_array_notation: bool = True
) -> tuple[list[tuple[str, str]], Schema]:
    """`ValidFieldPath`: `.a.b['c']` must name fields (or map keys) the schema declares.

    Returns the normalized path as ("child"|"key", name) steps and the schema found there."""
    steps: list[tuple[str, str]] = []
    tokens = _tokens(json_path)
    i = 0
    cur = schema

    def append(name: str, named: bool) -> None:
        nonlocal cur
        if not named:
            steps.append(("key", name))
            cur = cur["additionalProperties"] if isinstance(cur.get("additionalProperties"), dict) else {}
        else:
            steps.append(("child", name))
            props = cur.get("properties") or {}
            if name not in props:
                raise FieldPathError("does not refer to a valid field")
            cur = props[name]

    def named_here() -> bool:
        if cur.get("properties") is not None:
            return True
        if cur.get("additionalProperties") is not None:
            return False
        raise FieldPathError("does not refer to a valid field")

    while i < len(tokens):
        tok = tokens[i]
        if tok == "[":
            if not allow_array_notation:
                raise FieldPathError("array notation is not allowed")
            if i + 1 >= len(tokens):
                raise FieldPathError("unexpected end of JSON path")
            lit = tokens[i + 1]
            if len(lit) < 2 or lit[0] != "'" or lit[-1] != "'":
                raise FieldPathError(f"expected single quoted string but got {lit}")
            append(_unescape(lit[1:-1]), named_here())
            if i + 2 >= len(tokens):
                raise FieldPathError("unexpected end of JSON path")
            if tokens[i + 2] != "]":
                raise FieldPathError(f"expected ] but got {tokens[i + 2]}")
            i += 3
        elif tok == ".":
            if i + 1 >= len(tokens):
                raise FieldPathError("unexpected end of JSON path")
            append(tokens[i + 1], named_here())
            i += 2
        else:
            raise FieldPathError(f"expected [ or . but got: {tok}")
    return steps, cur


def _tokens(path: str) -> list[str]:
    """The scanner of ValidFieldPath: '.', '[', ']' alone; single-quoted strings whole."""
    out, i = [], 0
    while i < len(path):
        if path[i] == "'":
            j = i + 1
            while j < len(path) and not (path[j] == "'" and path[j - 1] != "\\"):
                j += 1
            out.append(path[i : j + 1])
            i = j + 1
        elif path[i] in ".[]":
            out.append(path[i])
            i += 1
        else:
            j = i
            while j < len(path) and path[j] not in ".[]":
                j += 1
            out.append(path[i:j])
            i = j
    return out


def _unescape(s: str) -> str:
    table = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v", "'": "'", "\\": "\\"}

    def repl(m: re.Match[str]) -> str:
        if m.group(1) not in table:
            raise FieldPathError(f"invalid string literal: invalid escape char {m.group(0)}")
        return table[m.group(1)]

    return re.sub(r"\\(.)", repl, s)
