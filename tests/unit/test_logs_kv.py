"""`logs.kv`: a value can never end its line or forge a field, whatever a client put in it
(issue 13, D9: `\\r` went through unescaped)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve_common.logs import kv


@pytest.mark.parametrize(
    "value,shown",
    [
        ("plain", "plain"),
        ("a b", '"a b"'),
        ("evil\r\nts=1 level=ERROR", '"evil\\r\\nts=1 level=ERROR"'),
        ("x\ry", '"x\\ry"'),
        ('q"\\', '"q\\"\\\\"'),
        ("\x1b[31mred", '"\\x1b[31mred"'),
        ("line\u2028sep", '"line\\u2028sep"'),
        ("bidi\u202eoverride", '"bidi\\u202eoverride"'),
        ("café", "café"),
        ("", '""'),
    ],
)
def test_values_are_quoted_and_escaped(value, shown):
    assert kv(v=value) == f"v={shown}"


def _first_value(line: str) -> tuple[str, str]:
    """Split `a=VALUE rest` the way a key=value reader does: VALUE is a bare word, or quoted
    up to the first quote that no backslash escapes."""
    assert line.startswith("a=")
    body = line[2:]
    if not body.startswith('"'):
        word, _, rest = body.partition(" ")
        return word, rest
    i = 1
    while body[i] != '"':
        i += 2 if body[i] == "\\" else 1
    return body[: i + 1], body[i + 2 :]


@given(st.text())
def test_any_value_stays_one_field_on_one_line(value):
    line = kv(a=value, b="end")
    assert all(c.isprintable() for c in line)  # no control or separator character survives
    _, rest = _first_value(line)
    assert rest == "b=end"  # the value could not start a field of its own
