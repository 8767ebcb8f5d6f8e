"""Structured key=value logging shared by every process of pdserve."""

from __future__ import annotations

import logging
import os
import sys


def kv(**fields: object) -> str:
    """Render fields as `key=value` pairs; values with spaces or quotes are quoted."""
    parts = []
    for key, value in fields.items():
        text = str(value)
        if not text or any(c in text for c in ' "=\t\n'):
            text = '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
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
