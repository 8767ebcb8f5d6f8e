"""Which prompts may share prefix-cache blocks: the *scope* a request's KV is cached under.

A prefix cache shared by everyone is a side channel: a tenant that sends a guess of another
tenant's prompt learns from `cached_tokens`, and from its time to first token, whether that
prefix was sent before. So the router names a scope with every request and the prefill roots
the prompt's block-hash chain in it (kv/prefix_cache.py, `scoped_salt`): prompts of different
scopes share nothing.
- With API keys, the scope is the request's tenant; tenants whose keys.yaml entry says
  `sharePrefixCache: true` share one scope. Without keys there is one tenant, so one scope.
- A request's own `cache_salt` (vLLM's field) narrows its tenant's scope further.
The scope is a JSON array of the two parts, so no choice of salt can spell another tenant's
scope (a tenant name cannot contain a quote; JSON escapes one in the salt).
"""

from __future__ import annotations

import json

from pdserve_worker.api.keys import Tenant

SHARED = "*shared*"  # the tenant scope of tenants with sharePrefixCache (not a valid tenant name)
MAX_CACHE_SCOPE_CHARS = 1024  # a tenant name and a cache_salt, JSON-quoted: what a worker accepts


def tenant_scope(tenant: Tenant) -> str:
    return SHARED if tenant.limits.share_prefix_cache else tenant.name


def cache_scope(tenant: Tenant, cache_salt: str | None = None) -> str:
    """The scope a request of `tenant` is cached under (see the module docstring)."""
    return json.dumps([tenant_scope(tenant), cache_salt or ""], ensure_ascii=True, separators=(",", ":"))
