"""Field paths and field errors as the API server prints them (k8s.io/apimachinery).

Ported from kubernetes/apimachinery `pkg/util/validation/field/{path.go,errors.go}` (read at
commit eed236ceee2c19c2753a3d93ac0631dc20750454): `Path.String()` joins children with dots and
writes keys and indices in brackets (`spec.versions[0].schema.openAPIV3Schema.properties[metadata]`);
`Error.Error()` is `"<field>: <type>[: <value>][: <detail>]"`, where the value is left out for
Required/Forbidden/TooLong/Internal and printed `%q` for strings, plain for numbers and booleans,
as JSON otherwise. The emulator's 422 answers are built from these, so a test can compare the
emulator's text with the upstream text word for word.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

OMIT = object()  # field.OmitValueType: the value is not printed


class Path:
    """An immutable field path (`field.Path`)."""

    __slots__ = ("_parts",)

    def __init__(self, *names: str) -> None:
        self._parts: tuple[tuple[str, str], ...] = tuple(("name", n) for n in names)

    @classmethod
    def _of(cls, parts: tuple[tuple[str, str], ...]) -> Path:
        p = cls()
        p._parts = parts
        return p

    def child(self, name: str, *more: str) -> Path:
        parts = self._parts
        for n in (name, *more):
            parts = parts + (("name", n),)
        return Path._of(parts)

    def key(self, key: str) -> Path:
        return Path._of(self._parts + (("index", key),))

    def index(self, i: int) -> Path:
        return Path._of(self._parts + (("index", str(i)),))

    def root(self) -> str:
        return self._parts[0][1] if self._parts else ""

    def __bool__(self) -> bool:
        return bool(self._parts)

    def __str__(self) -> str:
        if not self._parts:
            return "<nil>"
        out = ""
        for i, (kind, value) in enumerate(self._parts):
            if kind == "name":
                out += ("." if i > 0 and value else "") + value
            else:
                out += f"[{value}]"
        return out

    def __repr__(self) -> str:
        return f"Path({self})"


ROOT = Path()

REQUIRED = "FieldValueRequired"
FORBIDDEN = "FieldValueForbidden"
INVALID = "FieldValueInvalid"
NOT_SUPPORTED = "FieldValueNotSupported"
DUPLICATE = "FieldValueDuplicate"
TOO_LONG = "FieldValueTooLong"
TOO_MANY = "FieldValueTooMany"
TYPE_INVALID = "FieldValueTypeInvalid"
INTERNAL = "InternalError"

_TYPE_TEXT = {
    REQUIRED: "Required value",
    FORBIDDEN: "Forbidden",
    INVALID: "Invalid value",
    NOT_SUPPORTED: "Unsupported value",
    DUPLICATE: "Duplicate value",
    TOO_LONG: "Too long",
    TOO_MANY: "Too many",
    TYPE_INVALID: "Invalid value",
    INTERNAL: "Internal error",
}


class GoStruct(dict):  # type: ignore[type-arg]
    """A Go struct value: json.Marshal writes its fields in declaration order (maps: sorted keys)."""


def go_value(value: Any) -> str:
    """How `ErrorBody` prints a bad value: %v for numbers/booleans, %q for strings, else JSON."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return go_float(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, GoStruct):
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    return json.dumps(value, separators=(",", ":"), sort_keys=True, ensure_ascii=False)


def go_float(value: float) -> str:
    """Go's %v of a float64 (shortest repr; exponent form from 1e21)."""
    if value.is_integer() and abs(value) < 1e21:
        return str(int(value))
    text = repr(value)
    if "e" in text:
        mant, exp = text.split("e")
        sign = "-" if exp.startswith("-") else "+"
        text = f"{mant}e{sign}{exp.lstrip('+-').zfill(2)}"
    return text


@dataclass(frozen=True)
class FieldError:
    type: str
    field: str
    value: Any = OMIT
    detail: str = ""

    def body(self) -> str:
        text = _TYPE_TEXT.get(self.type, self.type)
        if self.type not in (REQUIRED, FORBIDDEN, TOO_LONG, INTERNAL) and self.value is not OMIT:
            text = f"{text}: {go_value(self.value)}"
        if self.detail:
            text += f": {self.detail}"
        return text

    def __str__(self) -> str:
        return f"{self.field}: {self.body()}"


def required(path: Path, detail: str = "") -> FieldError:
    return FieldError(REQUIRED, str(path), "", detail)


def forbidden(path: Path, detail: str) -> FieldError:
    return FieldError(FORBIDDEN, str(path), "", detail)


def invalid(path: Path, value: Any, detail: str) -> FieldError:
    return FieldError(INVALID, str(path), value, detail)


def type_invalid(path: Path, value: Any, detail: str) -> FieldError:
    return FieldError(TYPE_INVALID, str(path), value, detail)


def not_supported(path: Path, value: Any, valid: list[str]) -> FieldError:
    detail = "supported values: " + ", ".join(json.dumps(str(v)) for v in valid) if valid else ""
    return FieldError(NOT_SUPPORTED, str(path), value, detail)


def duplicate(path: Path, value: Any) -> FieldError:
    return FieldError(DUPLICATE, str(path), value)


def too_long(path: Path, max_length: int) -> FieldError:
    detail = (
        f"may not be more than {max_length} {'byte' if max_length == 1 else 'bytes'}"
        if max_length >= 0
        else "value is too long"
    )
    return FieldError(TOO_LONG, str(path), OMIT, detail)


def too_many(path: Path, actual: int, maximum: int) -> FieldError:
    detail = (
        f"must have at most {maximum} {'item' if maximum == 1 else 'items'}" if maximum >= 0 else "has too many items"
    )
    return FieldError(TOO_MANY, str(path), actual if actual >= 0 else OMIT, detail)


def internal(path: Path, detail: str) -> FieldError:
    return FieldError(INTERNAL, str(path), OMIT, detail)


def invalid_message(kind: str, name: str, errors: list[FieldError]) -> str:
    """`errors.NewInvalid`: one error inline, several as a bracketed, comma-separated list."""
    if len(errors) == 1:
        return f'{kind} "{name}" is invalid: {errors[0]}'
    return f'{kind} "{name}" is invalid: [{", ".join(str(e) for e in errors)}]'
