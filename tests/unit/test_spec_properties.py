"""Properties of the operator's spec validation over arbitrary documents (hypothesis).

Whatever a user applies, `parse_spec` either returns a spec or raises `ValidationError`
(never anything else, which would crash the reconciler instead of setting SpecValid=False),
`describe` names every problem under `spec.`, and a valid spec survives its own wire form
(what the operator writes back is what it read).
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve_operator import crd
from pdserve_operator import spec as s


def _field_names(schema: dict[str, Any], out: set[str]) -> set[str]:
    for name, sub in (schema.get("properties") or {}).items():
        out.add(name)
        _field_names(sub, out)
    for sub in schema.get("anyOf", []) + schema.get("allOf", []):
        _field_names(sub, out)
    if isinstance(schema.get("items"), dict):
        _field_names(schema["items"], out)
    return out


# The spec's real field names (so documents reach deep into the models), plus strangers.
NAMES = sorted(_field_names(crd.model_schema(s.PDInferenceServiceSpec), set()))
keys = st.one_of(st.sampled_from(NAMES), st.text(max_size=8))
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=True),
    st.text(max_size=12),
    st.sampled_from(["npu", "cpu", "cuda", "hixl", "auto", "builtin:smollm2-135m", "500m", "2Gi", "ClusterIP"]),
)
documents = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(keys, inner, max_size=5)),
    max_leaves=25,
)
spec_documents = st.dictionaries(keys, documents, max_size=6)


@settings(max_examples=400, deadline=None)
@given(doc=spec_documents)
def test_any_document_is_a_spec_or_a_validation_error_naming_fields(doc: dict[str, Any]) -> None:
    try:
        spec = s.parse_spec(doc)
    except s.ValidationError as exc:
        text = s.describe(exc)
        assert text.startswith("spec"), text
        for error in exc.errors():  # every problem is named by its field's path in the resource
            path = ".".join(str(part) for part in error["loc"])
            assert (f"spec.{path}: " if path else "spec: ") in text, (path, text)
        return
    assert s.parse_spec(spec.wire()) == spec


@settings(max_examples=200, deadline=None)
@given(doc=documents)
def test_a_spec_that_is_not_an_object_is_refused(doc: Any) -> None:
    if isinstance(doc, dict) or doc is None:
        return  # covered above (None is "no spec": every default)
    try:
        s.parse_spec(doc)
    except s.ValidationError:
        return
    raise AssertionError(f"{doc!r} was taken for a spec")
