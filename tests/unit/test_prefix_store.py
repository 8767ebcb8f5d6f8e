"""Prefix reuse on the prefill: a prompt whose prefix is cached computes only the rest, and the
KV and greedy tokens are those of computing it all."""

from __future__ import annotations

import pytest
import torch

from pdserve_worker.kv.cache import KVCache
from pdserve_worker.kv.prefix_store import PrefixStore
from pdserve_worker.model.loading.loader import load_model

SCOPE = '["anonymous",""]'


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(str(tiny_model_dir), dtype="float32")


def greedy_after(model, cache, slot, first_logits, position, count):
    out = [int(torch.argmax(first_logits))]
    while len(out) < count:
        logits = model.decode_step(cache, [slot], [position], [out[-1]])
        out.append(int(torch.argmax(logits[0])))
        position += 1
    return out


@torch.inference_mode()
def test_greedy_is_identical_with_and_without_the_prefix_cache(tiny) -> None:
    model, tok = tiny.model, tiny.tokenizer
    system = tok.encode("You are a helpful assistant. Answer briefly and precisely, in plain words.")
    turns = [system + tok.encode(t) for t in (" What is 2+2?", " Name a colour.", " What is 2+2? And 3+3?")]
    layout = tiny.config.kv_layout(2, 128, "float32")
    store = PrefixStore(layout, num_blocks=32, block_tokens=4, revision="test-rev")
    cached_counts = []
    for prompt in turns:
        plain = KVCache.allocate(layout)
        ref_logits = model.prefill(prompt, plain, 0)
        ref = greedy_after(model, plain, 0, ref_logits, len(prompt), 8)

        scratch = KVCache.allocate(layout)
        use = store.begin(prompt, scratch, 1, SCOPE)
        try:
            logits = model.prefill(prompt, scratch, 1, start=use.cached_tokens)
            store.finish(use, scratch, 1)
        finally:
            store.end(use)
        cached_counts.append(use.cached_tokens)
        # The pushed KV (the scratch slot) equals the full computation's.
        n = len(prompt)
        assert torch.allclose(scratch.slot(1)[:, :, :n], plain.slot(0)[:, :, :n], atol=1e-5)
        assert torch.allclose(logits, ref_logits, atol=1e-4)
        assert greedy_after(model, scratch, 1, logits, n, 8) == ref
    whole_system = len(system) // 4 * 4
    assert cached_counts[0] == 0
    assert cached_counts[1] >= whole_system - 4 and cached_counts[1] > 0
    assert cached_counts[2] >= len(turns[0]) // 4 * 4 - 4  # the third extends the first turn
    stats = store.stats()
    assert stats.hit_blocks * 4 == sum(cached_counts) and stats.pinned_blocks == 0


@torch.inference_mode()
def test_packed_prefill_with_cached_starts_matches(tiny) -> None:
    model, tok = tiny.model, tiny.tokenizer
    prompts = [tok.encode("Shared prefix of several words here, then") + tok.encode(t) for t in (" one", " two more")]
    layout = tiny.config.kv_layout(2, 64, "float32")
    ref = [model.prefill(p, KVCache.allocate(layout), 0) for p in prompts]
    store = PrefixStore(layout, num_blocks=16, block_tokens=4, revision="r")
    warm = KVCache.allocate(layout)
    use = store.begin(prompts[0], warm, 0, SCOPE)
    model.prefill(prompts[0], warm, 0)
    store.finish(use, warm, 0)
    store.end(use)
    scratch = KVCache.allocate(layout)
    uses = [store.begin(p, scratch, i, SCOPE) for i, p in enumerate(prompts)]
    got = model.prefill_batch(prompts, scratch, [0, 1], starts=[u.cached_tokens for u in uses])
    for u in uses:
        store.end(u)
    assert all(u.cached_tokens > 0 for u in uses)
    for r, g in zip(ref, got):
        assert torch.allclose(r, g, atol=1e-4)


def test_a_whole_prompt_hit_still_computes_its_last_token_and_other_revisions_miss(tiny) -> None:
    layout = tiny.config.kv_layout(1, 64, "float32")
    store = PrefixStore(layout, num_blocks=8, block_tokens=4, revision="a")
    prompt = list(range(5, 13))  # exactly two blocks
    cache = KVCache.allocate(layout)
    use = store.begin(prompt, cache, 0, SCOPE)
    tiny.model.prefill(prompt, cache, 0, start=use.cached_tokens)
    store.finish(use, cache, 0)
    store.end(use)
    again = store.begin(prompt, cache, 0, SCOPE)
    assert again.cached_tokens == 4  # not 8: the last token's logits must be computed
    store.end(again)
    store.end(again)  # idempotent on every path
    other = PrefixStore(layout, num_blocks=8, block_tokens=4, revision="b")
    assert other.hashes(prompt, SCOPE) != store.hashes(prompt, SCOPE)


def test_another_scope_finds_nothing_and_keeps_its_own_blocks(tiny) -> None:
    """Tenant isolation (issue #30): the same tokens under another scope miss, and its own
    prefill does not overwrite or unpublish the first scope's blocks."""
    layout = tiny.config.kv_layout(1, 64, "float32")
    store = PrefixStore(layout, num_blocks=16, block_tokens=4, revision="a")
    prompt = list(range(5, 18))
    cache = KVCache.allocate(layout)

    def run(scope: str) -> int:
        use = store.begin(prompt, cache, 0, scope)
        try:
            tiny.model.prefill(prompt, cache, 0, start=use.cached_tokens)
            store.finish(use, cache, 0)
        finally:
            store.end(use)
        return use.cached_tokens

    a, b = '["tenant-a",""]', '["tenant-b",""]'
    assert run(a) == 0
    assert run(b) == 0  # A's blocks are there, and B does not find them
    assert run(a) == 12 and run(b) == 12  # each finds its own
    assert run('["tenant-a","salt"]') == 0  # a cache_salt narrows the scope further
    assert store.hashes(prompt, a)[0] != store.hashes(prompt, b)[0]
    assert store.stats().cached_blocks == 9  # three scopes of three whole blocks
