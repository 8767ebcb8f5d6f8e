"""API keys: tenants and limits from the keys file, bearer parsing, reload on change, and no key
ever in an error message or a repr."""

from __future__ import annotations

import hashlib
import logging
import os

import pytest

from pdserve_worker.api.keys import (
    KeyFile,
    KeyFileError,
    KeyStore,
    TenantLimits,
    bearer_key,
)

KEY_A = "sk-alpha-0123456789abcdef"
KEY_B = "sk-bravo-0123456789abcdef"
KEY_C = "sk-charlie-0123456789abcd"

FILE = f"""
tenants:
  - name: interactive
    keys: ["{KEY_A}", "sha256:{hashlib.sha256(KEY_C.encode()).hexdigest()}"]
    requestsPerMinute: 600
    tokensPerMinute: 100000
    maxConcurrent: 4
    maxPriority: high
  - name: batch
    keys: ["{KEY_B}"]
    maxPriority: low
    weight: 0.5
"""


def test_keys_map_to_tenants_with_their_limits():
    store = KeyStore.parse(FILE)
    a = store.lookup(KEY_A)
    assert a is not None and a.name == "interactive"
    assert a.limits == TenantLimits(
        requests_per_minute=600, tokens_per_minute=100000, max_concurrent=4, max_priority="high"
    )
    assert store.lookup(KEY_C).name == "interactive"  # given as its digest only
    b = store.lookup(KEY_B)
    assert b.name == "batch" and b.limits.max_priority == "low" and b.limits.weight == 0.5
    assert b.limits.tokens_per_minute is None
    assert store.lookup("sk-unknown-0123456789abcdef") is None
    assert store.lookup(KEY_A[:-1]) is None and store.lookup(KEY_A + "x") is None
    assert store.lookup("sha256:" + hashlib.sha256(KEY_C.encode()).hexdigest()) is None  # the digest is no key
    assert KEY_A not in repr(store) and len(store) == 3


@pytest.mark.parametrize(
    "header,key",
    [
        (f"Bearer {KEY_A}", KEY_A),
        (f"bearer {KEY_A}", KEY_A),  # RFC 6750 / RFC 9110: the scheme is case-insensitive
        (f"  Bearer   {KEY_A}  ", KEY_A),
        (f"Basic {KEY_A}", None),
        ("Bearer", None),
        ("Bearer ", None),
        ("", None),
        (None, None),
    ],
)
def test_bearer_header(header, key):
    assert bearer_key(header) == key


@pytest.mark.parametrize(
    "text,message",
    [
        ("tenants: []", "tenants"),
        ("tenants:\n  - name: a\n    keys: ['short']", "16-512 printable ASCII"),
        ("tenants:\n  - name: a\n    keys: ['sha256:abc']", "64 lowercase hex"),
        (f"tenants:\n  - name: a\n    keys: ['{KEY_A}']\n  - name: a\n    keys: ['{KEY_B}']", "listed twice"),
        (f"tenants:\n  - name: a\n    keys: ['{KEY_A}']\n  - name: b\n    keys: ['{KEY_A}']", "one key is listed for"),
        (f"tenants:\n  - name: a\n    keys: ['{KEY_A}']\n    tokensPerMinute: 0", "greater than or equal to 1"),
        (f"tenants:\n  - name: a\n    keys: ['{KEY_A}']\n    maxPriority: urgent", "maxPriority"),
        (f"tenants:\n  - name: a\n    keys: ['{KEY_A}']\n    rpm: 5", "Extra inputs"),
        ("tenants: [", "not valid YAML"),
    ],
)
def test_bad_files_are_refused_without_quoting_a_key(text, message):
    with pytest.raises(KeyFileError) as caught:
        KeyStore.parse(text, "keys.yaml")
    assert message in str(caught.value)
    for key in (KEY_A, KEY_B, "short"):
        assert key not in str(caught.value)


def test_per_replica_share_rounds_up():
    limits = TenantLimits(requests_per_minute=10, tokens_per_minute=1000, max_concurrent=3)
    share = limits.per_replica(4)
    assert (share.requests_per_minute, share.tokens_per_minute, share.max_concurrent) == (3, 250, 1)
    assert limits.per_replica(1) is limits
    assert TenantLimits().per_replica(3) == TenantLimits()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _swap(path, text: str) -> None:
    """Replace the file the way a Secret volume does: write beside it, then rename over it."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def test_key_file_reloads_rotated_keys_without_restart(tmp_path, caplog):
    path = tmp_path / "keys.yaml"
    path.write_text(FILE)
    clock = Clock()
    keys = KeyFile(path, reload_interval_s=1.0, clock=clock)
    assert keys.lookup(KEY_A).name == "interactive"
    rotated = FILE.replace(KEY_A, "sk-alpha-ROTATED-0123456789")
    _swap(path, rotated)
    clock.now = 0.5  # within the interval: not checked yet
    assert keys.lookup(KEY_A) is not None
    clock.now = 1.0
    assert keys.lookup(KEY_A) is None
    assert keys.lookup("sk-alpha-ROTATED-0123456789").name == "interactive"
    assert keys.reloads == 1

    # A broken file keeps the keys in force and is logged without any key in the line.
    with caplog.at_level(logging.ERROR, logger="pdserve.router.auth"):
        _swap(path, rotated.replace("maxPriority: low", "maxPriority: urgent"))
        clock.now = 2.0
        assert keys.lookup("sk-alpha-ROTATED-0123456789").name == "interactive"
    assert keys.failed_reloads == 1
    assert "api_keys_reload_failed" in caplog.text and "maxPriority" in caplog.text
    assert "sk-" not in caplog.text

    # The file gone (mid-swap, or the volume unmounted): the keys stay.
    path.unlink()
    clock.now = 3.0
    assert keys.lookup(KEY_B).name == "batch"


def test_missing_key_file_is_a_startup_error(tmp_path):
    with pytest.raises(KeyFileError, match="does not exist"):
        KeyFile(tmp_path / "absent.yaml")
