"""The scope a request's prefix KV is cached under (api/cache_scope.py, issue #30): one per
tenant, one shared by the tenants that opt in, narrowed by vLLM's `cache_salt`, and sent with
every request the router hands its backend."""

from __future__ import annotations

import json

import httpx
import pytest

from pdserve_worker.api.app import create_app
from pdserve_worker.api.cache_scope import SHARED, cache_scope
from pdserve_worker.api.keys import ANONYMOUS, KeyStore, Tenant, TenantLimits
from pdserve_worker.kv.prefix_cache import block_hashes, cache_salt, scoped_salt
from support.router_fakes import ScriptedBackend, running_router

KEY_A = "sk-tenant-a-0123456789abcdef"
KEY_B = "sk-tenant-b-0123456789abcdef"
KEY_S1 = "sk-shared-1-0123456789abcdef"
KEY_S2 = "sk-shared-2-0123456789abcdef"
KEYS = KeyStore.parse(f"""
tenants:
  - name: a
    keys: ["{KEY_A}"]
  - name: b
    keys: ["{KEY_B}"]
  - name: s1
    keys: ["{KEY_S1}"]
    sharePrefixCache: true
  - name: s2
    keys: ["{KEY_S2}"]
    sharePrefixCache: true
""")


def tenant(name: str, share: bool = False) -> Tenant:
    return Tenant(name, TenantLimits(sharePrefixCache=share))


def test_scopes_separate_tenants_and_salts_and_join_the_sharing_ones():
    a, b = cache_scope(tenant("a")), cache_scope(tenant("b"))
    assert a != b
    assert (
        cache_scope(tenant("s1", True)) == cache_scope(tenant("s2", True)) == json.dumps([SHARED, ""]).replace(" ", "")
    )
    assert cache_scope(tenant("a"), "x") not in {a, cache_scope(tenant("b"), "x")}
    # No salt spells another tenant's scope: the parts are JSON-quoted, not concatenated.
    for salt in ('","b', '"],["b",""', "\\", "\u0000b", SHARED):
        scope = cache_scope(tenant("a"), salt)
        assert json.loads(scope) == ["a", salt]
        assert scope not in {b, cache_scope(tenant("s1", True))}


def test_the_scope_roots_the_hash_chain():
    salt = cache_salt("rev", "float32", 4)
    tokens = list(range(12))
    a = block_hashes(tokens, 4, scoped_salt(salt, cache_scope(tenant("a"))))
    b = block_hashes(tokens, 4, scoped_salt(salt, cache_scope(tenant("b"))))
    assert len(a) == len(b) == 3 and not set(a) & set(b)


def _post(url: str, key: str | None, **extra) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    body = {"model": "fake-model", "prompt": "hi", "max_tokens": 2, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=10)


def test_the_router_sends_each_request_its_tenants_scope(port):
    backend = ScriptedBackend()
    with running_router(create_app(backend, keys=KEYS), port) as url:
        for key in (KEY_A, KEY_B, KEY_S1, KEY_S2):
            assert _post(url, key).status_code == 200
        assert _post(url, KEY_A, cache_salt="team-1").status_code == 200
        refused = _post(url, KEY_A, cache_salt="")
        too_long = _post(url, KEY_A, cache_salt="x" * 257)
    scopes = [json.loads(call.cache_scope) for call in backend.calls]
    assert scopes == [["a", ""], ["b", ""], [SHARED, ""], [SHARED, ""], ["a", "team-1"]]
    for response in (refused, too_long):
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "cache_salt"


@pytest.mark.parametrize("chat", [False, True])
def test_without_keys_every_request_is_the_anonymous_tenants(port, chat):
    backend = ScriptedBackend()
    with running_router(create_app(backend), port) as url:
        if chat:
            body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "cache_salt": "s"}
            response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=10)
        else:
            response = _post(url, None)
    assert response.status_code == 200
    assert json.loads(backend.calls[0].cache_scope) == [ANONYMOUS, "s" if chat else ""]
