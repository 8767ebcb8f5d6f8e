"""Schema `pattern`s as the API server reads them: Go's `regexp` package, which implements RE2.

Python's `re` is not a stand-in: it accepts lookarounds and backreferences that Go refuses, its
`$` also matches before a final newline (Go's: only at the end of the text) and its `\\d`, `\\w`,
`\\s` take other scripts' characters (Go's are ASCII). google-re2 (already here for cel-python)
is the RE2 library itself, so syntax and matching agree with Go's; only the wording of a
syntax error differs (RE2's C++ messages, not Go's `error parsing regexp: ...`).
"""

from __future__ import annotations

import functools

import re2

_OPTIONS = re2.Options()
_OPTIONS.log_errors = False  # the error comes back as an exception; no stderr line per bad pattern


class PatternError(ValueError):
    """The pattern is not valid RE2 syntax; the message is RE2's."""


@functools.lru_cache(maxsize=512)
def compile_pattern(pattern: str):  # noqa: ANN201 (re2's compiled type)
    try:
        return re2.compile(pattern, _OPTIONS)
    except re2.error as exc:
        detail = exc.args[0] if exc.args else exc
        raise PatternError(detail.decode(errors="replace") if isinstance(detail, bytes) else str(detail)) from None


def search(pattern: str, text: str) -> bool:
    """`regexp.MatchString(pattern, text)`: is there a match anywhere in text (unanchored)?"""
    return compile_pattern(pattern).search(text) is not None
