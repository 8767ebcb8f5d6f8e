"""The resource's identity and what every sub-spec is built from.

`Model` is the base of every sub-spec: camelCase on the wire, unknown fields rejected, and its
cross-field `Rule`s, each carrying the CEL expression the API server enforces
(`x-kubernetes-validations`) and the Python predicate the operator enforces, side by side, so the
two cannot drift apart unseen (`tests/unit/test_operator_spec_crd.py` evaluates both on the same
inputs).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

from pydantic import AfterValidator, BaseModel, ConfigDict, WithJsonSchema, model_validator
from pydantic.alias_generators import to_camel

GROUP = "pdserve.dev"
VERSION = "v1alpha1"
KIND = "PDInferenceService"
PLURAL = "pdinferenceservices"
SINGULAR = "pdinferenceservice"
SHORT_NAMES = ("pdis",)
API_VERSION = f"{GROUP}/{VERSION}"

# A resource's name prefixes every child (`NAME-decode-headless` is the longest, and StatefulSet
# pod names carry a revision hash label limited to 63 characters), so names are kept short.
MAX_NAME_LENGTH = 40


@dataclass(frozen=True)
class Rule:
    """A cross-field rule, enforced by the API server (CEL) and by the operator (Python).

    `field` is the path relative to the model the rule sits on, used in error messages.
    """

    cel: str
    message: str
    holds: Callable[[Any], bool]
    field: str = ""

    def schema(self) -> dict[str, str]:
        out = {"rule": self.cel, "message": self.message}
        if self.field:
            out["fieldPath"] = "." + self.field
        return out


def _schema_rules(schema: dict[str, Any], cls: type) -> None:
    """Publish a model's `Rule`s as CEL in its JSON schema (read by crd.py)."""
    rules = cls.__dict__.get("rules", ())
    if rules:
        schema["x-kubernetes-validations"] = [r.schema() for r in rules]


class Model(BaseModel):
    """Base: camelCase on the wire, unknown fields rejected, `Rule`s checked after parsing."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        json_schema_extra=_schema_rules,
    )
    rules: ClassVar[tuple[Rule, ...]] = ()

    @model_validator(mode="after")
    def _check_rules(self) -> Model:
        broken = [rule.message for rule in type(self).rules if not rule.holds(self)]
        if broken:  # every broken rule at once, as the API server reports every CEL failure
            raise ValueError("; ".join(broken))
        return self

    def wire(self) -> dict[str, Any]:
        """The JSON form Kubernetes stores: camelCase, unset optionals left out."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


_QUANTITY = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)(([KMGTPE]i)|[numkMGTPE]|([eE][+-]?(\d+(\.\d*)?|\.\d+)))?$")


def _check_quantity(value: int | str) -> int | str:
    if isinstance(value, str) and not _QUANTITY.match(value):
        raise ValueError(f"not a Kubernetes quantity: {value!r} (e.g. 500m, 2Gi, 1)")
    return value


Quantity = Annotated[
    int | str,
    AfterValidator(_check_quantity),
    WithJsonSchema(
        {
            "x-kubernetes-int-or-string": True,
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": _QUANTITY.pattern,
            "description": "A Kubernetes quantity such as 500m, 2Gi or 1.",
        }
    ),
]

DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
