"""The forward on the tiny random model: against HF transformers, and against itself.

Self-consistency is what PD serving relies on: chunked prefill, prefill continued from a
cached prefix, a batch of slots of different lengths and a layer-sharded pool must all give
what one plain forward gives.
"""

from __future__ import annotations

import pytest
import torch

from pdserve_worker.kv.cache import KVCache
from pdserve_worker.model.engine import greedy_tokens
from pdserve_worker.model.loading.loader import load_model
from support.tiny_model import write_tiny_model

PROMPT = "Paris is the capital of France. 東京 🙂"


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(str(tiny_model_dir), dtype="float32")


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


def hf_logits(transformers, folder, ids: list[int]) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def all_logits(loaded, ids: list[int], max_len: int = 64) -> torch.Tensor:
    m = loaded.model
    cache = KVCache.allocate(loaded.config.kv_layout(1, max_len, "float32"))
    return m.head(m.run_layers(m.embed(ids), range(loaded.config.num_layers), cache, [0], [0]))[0]


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"tie_word_embeddings": True},
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        {
            "rope_theta": 500000.0,
            "max_position_embeddings": 512,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
        {"num_kv_heads": 4},  # plain multi-head attention
    ],
    ids=["default", "tied", "linear-rope", "llama3-rope", "mha"],
)
def test_logits_match_hf_transformers(tmp_path, transformers, overrides):
    folder = write_tiny_model(tmp_path, seed=3, **overrides)
    ours = load_model(str(folder), dtype="float32")
    # Long enough that llama3's scaled low frequencies matter (positions past original 64).
    ids = (ours.tokenizer.encode(PROMPT) * 8)[:120]
    expected = hf_logits(transformers, folder, ids)
    got = all_logits(ours, ids, max_len=128)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < 1e-4


def test_chunked_prefill_reports_each_chunk_once_in_order_and_equals_one_pass(tiny):
    ids = tiny.tokenizer.encode(PROMPT)
    layout = tiny.config.kv_layout(2, 64, "float32")
    whole, chunked = KVCache.allocate(layout), KVCache.allocate(layout)
    expected = tiny.model.prefill(ids, whole, 1)
    seen = []
    got = tiny.model.prefill(ids, chunked, 1, layers_per_chunk=3, on_chunk=seen.append)
    assert seen == [range(0, 3), range(3, 4)]
    assert torch.equal(got, expected)
    assert torch.equal(chunked.tensor, whole.tensor)
    assert torch.allclose(got, all_logits(tiny, ids)[-1], atol=1e-5)


def test_prefill_continued_from_a_cached_prefix_equals_one_pass(tiny):
    ids = tiny.tokenizer.encode(PROMPT)
    m, layers = tiny.model, range(tiny.config.num_layers)
    cache = KVCache.allocate(tiny.config.kv_layout(1, 64, "float32"))
    split = 7
    m.run_layers(m.embed(ids[:split]), layers, cache, [0], [0])
    tail = m.head(m.run_layers(m.embed(ids[split:]), layers, cache, [0], [split]))[0]
    assert torch.allclose(tail, all_logits(tiny, ids)[split:], atol=1e-5)


def test_batched_decode_of_scattered_slots_matches_each_alone(tiny):
    prompts = [
        tiny.tokenizer.encode(t) for t in ("Paris", "The quick brown fox", "12345 and", "a language model predicts")
    ]
    alone = [
        greedy_tokens(tiny.model, KVCache.allocate(tiny.config.kv_layout(1, 64, "float32")), 0, p, 10) for p in prompts
    ]

    cache = KVCache.allocate(tiny.config.kv_layout(8, 64, "float32"))
    slots = [6, 1, 2, 4]  # runs {1,2}, {4}, {6}: strided views and a masked batch
    tokens, positions = [], []
    for slot, p in zip(slots, prompts):
        tokens.append([int(tiny.model.prefill(p, cache, slot).argmax())])
        positions.append(len(p))
    for _ in range(9):
        logits = tiny.model.decode_step(cache, slots, positions, [t[-1] for t in tokens])
        for row in range(len(slots)):
            tokens[row].append(int(logits[row].argmax()))
            positions[row] += 1
    assert tokens == alone


def test_layer_sharded_pools_and_models_equal_the_whole(tiny, tiny_model_dir):
    ids = tiny.tokenizer.encode(PROMPT)
    cfg = tiny.config
    first = KVCache.allocate(cfg.kv_layout(2, 64, "float32", first_layer=0, num_layers=2))
    second = KVCache.allocate(cfg.kv_layout(2, 64, "float32", first_layer=2, num_layers=2))
    back = load_model(str(tiny_model_dir), dtype="float32", layers=range(2, 4))
    assert set(back.model.layers) == {2, 3}

    m = tiny.model
    hidden = m.run_layers(m.embed(ids), range(0, 2), first, [1], [0])
    logits = back.model.head(back.model.run_layers(hidden, range(2, 4), second, [1], [0]))[0]
    whole = KVCache.allocate(cfg.kv_layout(2, 64, "float32"))
    assert torch.allclose(logits, m.head(m.run_layers(m.embed(ids), range(4), whole, [1], [0]))[0], atol=1e-5)
    assert torch.equal(second.tensor[1], whole.tensor[1, 2:4])
    with pytest.raises(IndexError, match="layer 1 not loaded"):
        back.model.run_layers(hidden, range(1, 2), first, [1], [0])


def test_bf16_stays_close_to_fp32(tiny_model_dir, tiny):
    bf16 = load_model(str(tiny_model_dir), dtype="bfloat16")
    ids = tiny.tokenizer.encode(PROMPT)
    got = bf16.model.prefill(ids, KVCache.allocate(bf16.config.kv_layout(1, 64, "bfloat16")), 0)
    ref = tiny.model.prefill(ids, KVCache.allocate(tiny.config.kv_layout(1, 64, "float32")), 0)
    assert got.dtype == torch.float32
    assert (got - ref).abs().max().item() < 0.1 * ref.std().item()


def test_bad_calls_name_what_was_wrong(tiny):
    m, cfg = tiny.model, tiny.config
    cache = KVCache.allocate(cfg.kv_layout(2, 16, "float32"))
    with pytest.raises(ValueError, match="dtype"):
        m.prefill([1, 2], KVCache.allocate(cfg.kv_layout(1, 16, "bfloat16")), 0)
    with pytest.raises(IndexError, match="slot 2"):
        m.decode_step(cache, [2], [0], [1])
    with pytest.raises(IndexError, match="max_len 16"):
        m.decode_step(cache, [0], [16], [1])
    with pytest.raises(ValueError, match="twice"):
        m.decode_step(cache, [0, 0], [1, 2], [1, 1])
    with pytest.raises(ValueError, match="exceeds the KV slot"):
        m.prefill(list(range(17)), cache, 0)
    with pytest.raises(ValueError, match="outside vocabulary"):
        m.prefill([cfg.vocab_size], cache, 0)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        cfg.kv_layout(1, cfg.max_position_embeddings + 1)
