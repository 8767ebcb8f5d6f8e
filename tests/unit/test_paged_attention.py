"""Attention through block tables gives the logits of the slot pool, with scattered blocks."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pdserve_worker.kv.cache import KVCache
from pdserve_worker.kv.paged import PagedKVCache
from pdserve_worker.model.loading.loader import load_model

TEXTS = ("Paris is the capital of", "The quick brown fox jumps over", "12345 678", "A language model")


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(str(tiny_model_dir), dtype="float32")


def paged(tiny, num_blocks: int = 40, bt: int = 4) -> PagedKVCache:
    c = tiny.config
    layout = c.kv_layout(4, 64, "float32")
    return PagedKVCache.allocate(replace(layout, block_tokens=bt, num_blocks=num_blocks))


def test_binding_is_checked_and_rows_follow_the_table(tiny) -> None:
    cache = paged(tiny)
    with pytest.raises(KeyError, match="handle 3"):
        cache.table(3)
    with pytest.raises(IndexError, match="outside pool"):
        cache.bind(0, [39, 40])
    cache.bind(1, [7, 2])
    assert cache.token_rows(1, 2, 6).tolist() == [30, 31, 8, 9]
    assert cache.capacity(1) == 8
    with pytest.raises(IndexError):
        cache.token_rows(1, 0, 9)
    cache.unbind(1)
    with pytest.raises(KeyError):
        cache.table(1)


@torch.inference_mode()
def test_prefill_and_batched_decode_through_scattered_blocks_match_the_slot_pool(tiny) -> None:
    model, tok = tiny.model, tiny.tokenizer
    prompts = [tok.encode(t) for t in TEXTS]
    steps = 10
    slots = KVCache.allocate(tiny.config.kv_layout(len(prompts), 64, "float32"))
    pool = paged(tiny)
    # Deliberately scattered, interleaved, out of order tables.
    tables = [[31, 3, 17, 9, 22, 0], [5, 38, 12, 26, 1, 33], [14, 7, 29, 36, 20, 2], [11, 24, 8, 35, 16, 27]]
    for handle, table in enumerate(tables):
        pool.bind(handle, table)

    # Two prompts alone, two packed together: each path of the paged plan.
    ref_first = [model.prefill(p, slots, i) for i, p in enumerate(prompts)]
    got_first = [model.prefill(prompts[0], pool, 0), model.prefill(prompts[1], pool, 1)]
    got_first += list(model.prefill_batch(prompts[2:], pool, [2, 3]))
    for ref, got in zip(ref_first, got_first):
        assert torch.allclose(ref, got, atol=1e-4)

    ref_tokens = [int(torch.argmax(x)) for x in ref_first]
    got_tokens = list(ref_tokens)
    positions = [len(p) for p in prompts]
    order = [2, 0, 3, 1]  # rows in any handle order
    for _ in range(steps):
        ref = model.decode_step(slots, order, [positions[i] for i in order], [ref_tokens[i] for i in order])
        got = model.decode_step(pool, order, [positions[i] for i in order], [got_tokens[i] for i in order])
        assert torch.allclose(ref, got, atol=1e-4)
        for row, i in enumerate(order):
            ref_tokens[i] = int(torch.argmax(ref[row]))
            got_tokens[i] = int(torch.argmax(got[row]))
            positions[i] += 1
        assert ref_tokens == got_tokens

    # The KV landed in the tables' blocks: token j of handle 1, layer 0 equals the slot pool's.
    for j in range(positions[1]):
        row = tables[1][j // 4] * 4 + j % 4
        assert torch.allclose(pool.keys(0)[row], slots.keys(0)[1, j], atol=1e-5)


@torch.inference_mode()
def test_a_resumed_prefill_reads_its_earlier_tokens_through_the_table(tiny) -> None:
    """Prefill of a suffix from position p over a prefix already in the blocks (prefix reuse)."""
    model, tok = tiny.model, tiny.tokenizer
    prompt = tok.encode("The quick brown fox jumps over the lazy dog again and again")
    slots = KVCache.allocate(tiny.config.kv_layout(1, 64, "float32"))
    ref = model.prefill(prompt, slots, 0)
    pool = paged(tiny)
    pool.bind(0, [9, 4, 30, 1, 12, 6, 7, 8])
    split = 8
    hidden = model.embed(prompt[:split])
    model.run_layers(hidden, range(tiny.config.num_layers), pool, [0], [0])
    hidden = model.embed(prompt[split:])
    hidden = model.run_layers(hidden, range(tiny.config.num_layers), pool, [0], [split])
    assert torch.allclose(model.head(hidden[0, -1]), ref, atol=1e-4)


def test_a_prompt_longer_than_its_table_is_refused(tiny) -> None:
    pool = paged(tiny)
    pool.bind(0, [1, 2])
    with pytest.raises(ValueError, match="max_len 8"):
        tiny.model.prefill(list(range(9)), pool, 0)
    with pytest.raises(IndexError, match="outside handle 0"):
        tiny.model.decode_step(pool, [0], [8], [1])
