"""#58 A10 against real processes (`pdserve local --api-keys --prefix-disk-dir`): the disk tier's
files were world-readable (0644) in shared folders, and `/tokenize` and `/detokenize` parsed the
body before they checked the key. Now a caller without a key hears 401 before any body is read,
however malformed or large, and the prefill's spilled KV is 0600 in 0700 folders. (A10's
`logit_bias` ids outside the vocabulary: tests/security/test_a8_client_errors.py.)"""

from __future__ import annotations

import httpx
import pytest

from support.deployments import local_deployment

pytestmark = pytest.mark.slow

KEY = "sk-a10-tenant-0123456789abcdef"
BLOCK, MAX_LEN = 16, 256
WORDS = "amber basalt cobalt dune ember fjord glacier harbor iris jasper kelp lagoon meadow nectar onyx".split()
PROMPTS = [" ".join(WORDS[(i * 7 + j * (i + 3)) % len(WORDS)] for j in range(20)) + f" #{i}" for i in range(3)]


@pytest.fixture(scope="module")
def run(tiny_model_dir, tmp_path_factory):
    keys = tmp_path_factory.mktemp("a10-keys") / "keys.yaml"
    keys.write_text(f'tenants:\n  - name: t\n    keys: ["{KEY}"]\n')
    disk = tmp_path_factory.mktemp("a10-disk") / "prefix"
    local = local_deployment(
        tmp_path_factory.mktemp("a10-local"),
        tiny_model_dir,
        decode=1,
        slots=2,
        max_len=MAX_LEN,
        api_keys=keys,
        prefix_cache_tokens=4 * BLOCK,  # a RAM tier smaller than the prompts: blocks spill to disk
        prefix_disk_dir=disk,
    )
    local.disk = disk  # type: ignore[attr-defined]
    yield local
    local.stop_cleanly()


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
@pytest.mark.parametrize("content", [b"{not json", b'{"prompt": ' + b"[1, " * 2_000_000 + b"1]}"])
def test_a_caller_without_a_key_hears_401_before_the_body_is_read(run, path, content):
    headers = {"content-type": "application/json"}
    for auth in ({}, {"authorization": "Bearer sk-not-a-key"}):
        reply = httpx.post(f"{run.url}{path}", content=content, headers=headers | auth, timeout=30)
        assert reply.status_code == 401, (path, reply.status_code, reply.text[:200])
        assert reply.json()["error"]["code"] == "invalid_api_key"
    # With the key the same body is the client's error, named as such (not a 500).
    keyed = httpx.post(f"{run.url}{path}", content=content, headers=headers | {"authorization": f"Bearer {KEY}"})
    assert keyed.status_code in (400, 413), (path, keyed.status_code, keyed.text[:200])


def test_spilled_kv_is_the_workers_alone(run):
    auth = {"authorization": f"Bearer {KEY}"}
    model = httpx.get(f"{run.url}/v1/models", headers=auth, timeout=5).json()["data"][0]["id"]
    for text in PROMPTS:
        body = {"model": model, "prompt": text, "max_tokens": 2, "temperature": 0}
        assert httpx.post(f"{run.url}/v1/completions", json=body, headers=auth, timeout=60).status_code == 200
    files = list(run.disk.rglob("*.kv"))
    assert files, "nothing spilled to the disk tier"
    assert {f.stat().st_mode & 0o777 for f in files} == {0o600}
    folders = {f.parent for f in files} | {f.parent.parent for f in files}
    assert {d.stat().st_mode & 0o777 for d in folders} == {0o700}, sorted(str(d) for d in folders)
