"""#30's cross-tenant prefix probe against real processes: with API keys and the prefix cache on,
tenant B sends the prompt tenant A sent before. Before, B's answer reported cached_tokens of
nearly the whole prefix (and came 13x sooner): a side channel that tells B what A asked. Now the
prefill roots every prompt's block hashes in its tenant's scope (api/cache_scope.py), so B
finds nothing of A's, while each tenant still reuses its own prompts, tenants that opted in
(`sharePrefixCache`) share theirs, and a request's `cache_salt` narrows its own scope.

`pdserve local --api-keys`, tiny model, PD (a prefill, a decode, two routers taking turns) and
colocated, with the prefix cache as `pdserve local` sizes it by default (no cache flag).
"""

from __future__ import annotations

import httpx
import pytest

from support.deployments import local_deployment
from support.local_run import LocalRun

pytestmark = pytest.mark.slow

KEYS = {name: f"sk-{name}-0123456789abcdef0123" for name in ("alice", "bob", "team1", "team2")}
SHARING = {"team1", "team2"}
BLOCK = 16  # the default prefix block
SECRET = (
    "Internal memo for Alice only: the acquisition of the northern warehouse closes on the fifth, "
    "the price is forty one million, and nobody outside the board may know before the announcement. "
)


@pytest.fixture(scope="module", params=["pd", "colocated"])
def local(request, tiny_model_dir, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.yaml"
    lines = ["tenants:"]
    for name, key in KEYS.items():
        lines += [f"  - name: {name}", f'    keys: ["{key}"]']
        if name in SHARING:
            lines.append("    sharePrefixCache: true")
    keys.write_text("\n".join(lines) + "\n")
    # PD behind two routers: requests alternate between them, isolation holds across both.
    mode = {"decode": 1, "routers": 2} if request.param == "pd" else {"colocated": True}
    run = local_deployment(
        tmp_path_factory.mktemp(f"tenants-{request.param}"), tiny_model_dir, **mode, slots=2, max_len=512, api_keys=keys
    )
    assert len(run.manifest["routers"]) == (2 if request.param == "pd" else 1)
    assert run.manifest["routers"][0] == run.url
    yield run
    run.stop_cleanly()


SENT = [0]


def cached(local: LocalRun, tenant: str, prompt: str, **extra) -> int:
    routers = local.manifest.get("routers") or [local.url]
    url = routers[SENT[0] % len(routers)]  # alternate between the routers, as a load balancer would
    SENT[0] += 1
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    model = httpx.get(f"{url}/v1/models", headers=headers).json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}
    reply = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)
    assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]
    assert usage["prompt_tokens"] > 4 * BLOCK
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def test_a_tenant_never_finds_another_tenants_prompt_cached(local):
    probe = SECRET + "Summarise it."
    assert cached(local, "alice", probe) == 0
    assert cached(local, "alice", probe) >= 4 * BLOCK  # the cache is on and alice reuses her own
    assert cached(local, "bob", SECRET + "Summarise it!") == 0  # the attack: bob learns nothing of alice's prefix
    assert cached(local, "bob", probe) >= 4 * BLOCK  # ... while his own copy is his to reuse
    assert cached(local, "team1", probe) == 0  # a sharing tenant does not see the others' either


def test_sharing_tenants_share_and_a_cache_salt_narrows(local):
    system = "Shared system prompt of the platform team: answer briefly, cite the runbook, be kind. " * 2
    assert cached(local, "team1", system + "Q1") == 0
    assert cached(local, "team2", system + "Q2") >= 2 * BLOCK  # team2 reuses team1's system prompt
    assert cached(local, "alice", system + "Q3") == 0  # alice did not opt in
    assert cached(local, "team2", system + "Q4", cache_salt="private") == 0  # a salt is its own scope
    assert cached(local, "team2", system + "Q5", cache_salt="private") >= 2 * BLOCK


def test_a_tenant_never_finds_another_tenants_conversation_on_the_decode(local):
    """A decode keeps a conversation's blocks (its prompts', kv/decode_prefix.py) in the
    tenant's scope: bob sending alice's next turn finds none of them, alice finds hers."""
    routers = local.manifest.get("routers") or [local.url]

    def complete(tenant: str, prompt: str, max_tokens: int) -> tuple[str, int]:
        headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
        model = httpx.get(f"{routers[0]}/v1/models", headers=headers).json()["data"][0]["id"]
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        reply = httpx.post(f"{routers[0]}/v1/completions", json=body, headers=headers, timeout=60)
        assert reply.status_code == 200, reply.text
        usage = reply.json()["usage"]
        return reply.json()["choices"][0]["text"], (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)

    turn1 = "Conversation with Alice. " + SECRET + "What closes on the fifth?"
    answer, cached_first = complete("alice", turn1, 24)
    assert cached_first == 0
    turn2 = turn1 + answer + " And the price?"
    assert complete("bob", turn2, 1)[1] == 0  # the attack: alice's next turn, sent by bob
    assert complete("alice", turn2, 1)[1] >= 4 * BLOCK  # alice reuses her own conversation
