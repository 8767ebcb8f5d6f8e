"""The Secret: the broker token and the role credentials derived from it (pdserve_common/credentials.py)."""

from __future__ import annotations

import base64
from typing import Any

from pdserve_common import credentials as C
from pdserve_operator.reconcile.children.meta import Owner, object_meta, secret_name

TOKEN_KEY = C.TOKEN_KEY


def secret(owner: Owner, token: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": object_meta(owner, secret_name(owner.name)),
        "type": "Opaque",
        "data": {key: base64.b64encode(value.encode()).decode() for key, value in C.secret_data(token).items()},
    }


def token_of(secret_obj: dict[str, Any] | None) -> str | None:
    """The broker token kept in a live Secret, if it holds a usable one."""
    raw = ((secret_obj or {}).get("data") or {}).get(TOKEN_KEY)
    if not raw:
        return None
    try:
        token = base64.b64decode(raw, validate=True).decode()
    except (ValueError, UnicodeDecodeError):
        return None
    return token or None
