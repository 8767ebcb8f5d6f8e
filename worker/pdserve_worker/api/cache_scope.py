"""Which prompts may share prefix-cache blocks: the *scope* a request's KV is cached under.

A prefix cache shared by everyone is a side channel: a tenant that sends a guess of another
tenant's prompt learns from `usage.prompt_tokens_details.cached_tokens`, and from how fast its
first token comes, whether that prefix was sent before (round 3 measured a 13x TTFT gap). So
the router names a scope with every request and the prefill roots the prompt's block-hash
chain in it (kv/prefix_cache.py, `scoped_salt`): prompts of different scopes share nothing.

- With API keys, the scope is the request's tenant: a tenant reuses its own prompts' KV only.
  A tenant whose entry in keys.yaml says `sharePrefixCache: true` joins the one shared scope,
  with every other tenant that says so (a system prompt common to all of them is computed
  once); the others never see it.
- Without keys there is one tenant (anonymous), so one scope, as on any single-user server.
- A request may name its own `cache_salt` (vLLM's field, vllm/entrypoints/openai/protocol.py):
  it narrows the scope further, so that only requests naming the same salt, of the same
  tenant scope, share blocks.

The scope is a JSON array of the two parts, so no choice of salt can spell another tenant's
scope (a tenant name cannot contain a quote; JSON escapes one in the salt).
"""

from __future__ import annotations

import json

from pdserve_worker.api.keys import Tenant

SHARED = "*shared*"  # the tenant scope of tenants with sharePrefixCache (not a valid tenant name)


def tenant_scope(tenant: Tenant) -> str:
    return SHARED if tenant.limits.share_prefix_cache else tenant.name


def cache_scope(tenant: Tenant, cache_salt: str | None = None) -> str:
    """The scope a request of `tenant` is cached under (see the module docstring)."""
    return json.dumps([tenant_scope(tenant), cache_salt or ""], ensure_ascii=True, separators=(",", ":"))
