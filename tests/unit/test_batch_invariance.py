"""A request's logits do not depend on the other requests in its decode steps (batch invariance).

Why it matters: a seeded request must give the same text under any load, and a live migration
(issue #17) puts a request among new neighbours mid-stream. On the quantized route the
activations are rounded to bf16 before each int4 product, so the last-bit difference that
padding a row to a longer neighbour's key length made in SDPA became different logits (SmolLM2:
up to 0.375) and a seeded stream drifted after ~10 tokens. Decode attention now runs each row
over exactly its own keys: all rows in one call of the native kernel (model/layers/native.py),
or, where it is not built, each row in its own SDPA call (model/layers/paged_attention.py,
slot_attention.runs); torch's int4 kernel and every other op of a step are row-wise. Checked here
bit for bit, with a neighbour longer than the row (the padded case), on both KV pools, in fp32
and bf16, through both attention paths.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pdserve_worker.kv.cache import KVCache
from pdserve_worker.kv.paged import PagedKVCache
from pdserve_worker.model.layers import native
from pdserve_worker.model.loading.loader import load_model

SHORT = [5, 9, 13, 17, 21, 25, 29]
LONG = [(7 * i) % 90 + 3 for i in range(150)]
STEPS = 12


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def int4_model(request, tiny_model_dir):
    loaded = load_model(str(tiny_model_dir), dtype=request.param, weights="int4")
    return loaded.model


def pool(model, kind: str):
    layout = model.config.kv_layout(4, 256, str(model.dtype).removeprefix("torch."))
    if kind == "slots":
        return KVCache.allocate(layout)
    cache = PagedKVCache.allocate(replace(layout, block_tokens=16, num_blocks=64))
    for handle in range(3):
        cache.bind(handle, list(range(handle * 16, handle * 16 + 16)))
    return cache


def steps(model, cache, prompts: list[list[int]], slots: list[int]) -> list[torch.Tensor]:
    """Row 0's logits over STEPS greedy decode steps, the other rows alongside it."""
    first = model.prefill_batch(prompts, cache, slots)
    tokens = [int(row.argmax()) for row in first]
    positions = [len(p) for p in prompts]
    seen = []
    for _ in range(STEPS):
        logits = model.decode_step(cache, slots, positions, tokens)
        seen.append(logits[0].clone())
        tokens = [int(row.argmax()) for row in logits]
        positions = [p + 1 for p in positions]
    return seen


@pytest.fixture(params=["kernel", "torch"])
def attention(request, monkeypatch):
    """Which decode attention the steps use: the native kernel, or SDPA row by row."""
    if request.param == "kernel" and not native.available():
        pytest.skip("the native kernel could not be built here (the torch path is tested)")
    monkeypatch.setattr(native, "_state", {"ok": request.param == "kernel"})
    return request.param


@pytest.mark.parametrize("kind", ["slots", "paged"])
def test_a_rows_logits_are_bitwise_the_same_alone_and_beside_a_longer_row(int4_model, kind, attention):
    alone = steps(int4_model, pool(int4_model, kind), [SHORT], [0])
    # slots 0 and 1 are adjacent: the slot pool used to read them in one padded SDPA call
    beside = steps(int4_model, pool(int4_model, kind), [SHORT, LONG, LONG[:40]], [0, 1, 2])
    for step, (a, b) in enumerate(zip(alone, beside)):
        assert torch.equal(a, b), f"step {step}: logits differ by {(a - b).abs().max().item()} beside other rows"
