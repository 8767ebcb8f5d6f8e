"""The prefix cache's disk tier through real processes (issue #30): `pdserve local` with a RAM
tier far smaller than the working set and `--prefix-disk-dir`. A second pass finds the prompts
from disk; a prefill killed by SIGKILL and restarted finds them on its first pass; a disk whose
files were all damaged is detected and the KV computed — and every answer is the one greedy
generation without any cache gives."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from support.local_run import LocalRun

pytestmark = pytest.mark.slow

MAX_LEN = 256
BLOCK = 16
WORDS = "amber basalt cobalt dune ember fjord glacier harbor iris jasper kelp lagoon meadow nectar onyx".split()


def prompt(i: int) -> str:
    """~100 tokens, distinct from the first word on (no two prompts share a block)."""
    return " ".join(WORDS[(i * 7 + j * (i + 3)) % len(WORDS)] for j in range(20)) + f" #{i}"


PROMPTS = [prompt(i) for i in range(6)]  # ~36 blocks against a RAM tier of 4


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    from pdserve_worker.model.engine import generate
    from pdserve_worker.model.loading.loader import load_model
    from pdserve_worker.model.sampling.params import SamplingParams

    loaded = load_model(str(tiny_model_dir), dtype="float32")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    ids = [loaded.tokenizer.encode(p) for p in PROMPTS]
    return [done.text for done in generate(loaded.model, loaded.tokenizer, ids, params, max_len=MAX_LEN)]


def ask(url: str, text: str) -> tuple[str, int]:
    model = httpx.get(f"{url}/v1/models", timeout=5).json()["data"][0]["id"]
    body = {"model": model, "prompt": text, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]
    assert usage["prompt_tokens"] >= 5 * BLOCK
    return reply.json()["choices"][0]["text"], (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def prefill_metrics(run: LocalRun) -> str:
    [child] = [c for c in run.manifest["children"] if c["role"] == "prefill"]
    return httpx.get(f"http://{child['http']}/metrics", timeout=5).text


def metric(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name) and " " in line)


def wait_restarted(run: LocalRun, old_pid: int, timeout_s: float = 120.0) -> None:
    """Until `pdserve local` restarted the prefill and the router routes to it again."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        children = [c for c in run.manifest["children"] if c["role"] == "prefill"]
        if children and children[0]["pid"] != old_pid:
            # The killed one stays registered until its lease lapses: probe with a short prompt
            # (shares no block with PROMPTS) until one is served.
            model = httpx.get(f"{run.url}/v1/models", timeout=5).json()["data"][0]["id"]
            body = {"model": model, "prompt": "ping", "max_tokens": 1}
            if httpx.post(f"{run.url}/v1/completions", json=body, timeout=60).status_code == 200:
                return
        time.sleep(0.2)
    raise AssertionError(f"the prefill was not restarted and registered within {timeout_s:.0f}s")


def test_blocks_come_back_from_disk_after_eviction_a_kill_and_damage(
    tiny_model_dir, tmp_path, reference, local_deployments
):
    disk = tmp_path / "prefix-disk"
    run = local_deployments(
        tmp_path / "run",
        tiny_model_dir,
        decode=1,
        slots=2,
        max_len=MAX_LEN,
        threads=1,
        prefix_cache_tokens=4 * BLOCK,
        prefix_disk_dir=disk,
        on_exit="restart",
        env={
            "PDSERVE_DECODE_PREFIX_CACHE": "0"
        },  # (the prefill's cache under test: the decode's own (kv/decode_prefix.py) would serve repeats first)
    )
    try:
        first = [ask(run.url, p) for p in PROMPTS]
        assert [text for text, _ in first] == reference
        assert all(cached == 0 for _, cached in first)
        second = [ask(run.url, p) for p in PROMPTS]
        assert [text for text, _ in second] == reference
        assert all(cached >= 4 * BLOCK for _, cached in second), second  # RAM holds 4 blocks: the rest came from disk
        metrics = prefill_metrics(run)
        assert metric(metrics, 'pdserve_prefill_prefix_tier_hit_tokens_total{tier="disk"}') > 0
        # Each prompt published what RAM could hold of it (4 blocks), and all of that went to disk.
        assert metric(metrics, "pdserve_prefill_prefix_disk_spilled_blocks_total") >= len(PROMPTS) * 4
        # The prompts' KV is the worker's user's alone (#58 A10: the files were 0644).
        assert {p.stat().st_mode & 0o777 for p in disk.rglob("*.kv")} == {0o600}
        folders = {p.parent for p in disk.rglob("*.kv")}  # a geometry's folder, in the prefill's own
        assert {d.stat().st_mode & 0o777 for d in folders | {f.parent for f in folders}} == {0o700}

        [child] = [c for c in run.manifest["children"] if c["role"] == "prefill"]
        os.kill(child["pid"], signal.SIGKILL)
        wait_restarted(run, child["pid"])
        third = [ask(run.url, p) for p in PROMPTS[:3]]
        assert [text for text, _ in third] == reference[:3]
        assert all(cached >= 4 * BLOCK for _, cached in third), third  # warm after a restart

        for path in disk.rglob("*.kv"):  # a bad disk: every file damaged
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0x5A
            path.write_bytes(bytes(data))
        text, cached = ask(run.url, PROMPTS[5])  # not in RAM (the RAM tier holds the last ones asked)
        assert text == reference[5] and cached == 0
        assert metric(prefill_metrics(run), "pdserve_prefill_prefix_disk_corrupt_blocks_total") >= 1
    finally:
        run.stop_cleanly()
