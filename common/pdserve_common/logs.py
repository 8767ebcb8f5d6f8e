"""Structured key=value logging shared by every process of pdserve."""

from __future__ import annotations

import logging
import os
import sys

_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(char: str) -> str:
    if char in _ESCAPES:
        return _ESCAPES[char]
    if char.isprintable():
        return char
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def kv(**fields: object) -> str:
    """Render fields as `key=value` pairs.

    A value with a space, quote, backslash, `=` or any character that is not printable is
    quoted, and inside the quotes backslash, quote and every character that is not printable
    are escaped (\\n, \\r, \\t, \\xNN, \\uNNNN). Not printable is Python's `str.isprintable`:
    control characters such as \\r (which would let a value forge a line on a terminal or a
    line-based collector), Unicode line separators, bidi overrides, lone surrogates. So a value
    can never end its line or start a field of its own, whatever a client put in it.
    """
    parts = []
    for key, value in fields.items():
        text = str(value)
        if not text or not text.isprintable() or any(c in text for c in ' "=\\'):
            text = '"' + "".join(map(_escape, text)) + '"'
        parts.append(f"{key}={text}")
    return " ".join(parts)


def setup(process: str, level: str | None = None) -> logging.Logger:
    """Configure the root logger once per process: timestamp, level, process name, message."""
    level = (level or os.environ.get("PDSERVE_LOG_LEVEL", "INFO")).upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(f"ts=%(asctime)s level=%(levelname)s proc={process} logger=%(name)s %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    return logging.getLogger(f"pdserve.{process}")
