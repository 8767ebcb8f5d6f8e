"""Every family the engine serves, against transformers running the very same folder.

Each tiny model is built by transformers from its own config class with the structure of a
published checkpoint (tests/model_families.py: Qwen2.5-7B-Instruct, Qwen3-0.6B,
DeepSeek-R1-Distill-Qwen-1.5B, Llama-3.1-8B-Instruct, Mistral-7B-Instruct-v0.3) and saved as
sharded safetensors. The reference is always transformers' forward (fp32, no cache), never
our own earlier output. Then the properties PD serving relies on: chunked prefill equals one
pass, a batch equals each request alone, layer-sharded members equal the whole model.
"""

from __future__ import annotations

import json

import pytest
import torch

from pdserve_worker.kv.cache import KVCache
from pdserve_worker.model.config import ModelConfig
from pdserve_worker.model.engine import greedy_tokens
from pdserve_worker.model.loading.loader import load_model
from pdserve_worker.model.shapes import parameter_count, weight_shapes
from pdserve_worker.model.tokenizer import Tokenizer
from support.model_families import FAMILIES, build_family, hf_greedy, hf_logits, hf_model

NAMES = list(FAMILIES)
TEXTS = [
    "Paris is the capital of",
    "Unicode text: café, 東京 🙂 and 12345 digits.\n\nA language model predicts the next token",
    "The quick brown fox jumps over the lazy dog. Prefill computes the cache of a prompt; decode reads it "
    "and writes one token at a time. Berlin is the capital of Germany. I'm sure you'll like it.",
]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
MAX_LEN = 160


@pytest.fixture(scope="module", params=NAMES)
def family(request, family_dirs):
    """(name, folder, our loaded model in fp32, transformers' model)."""
    folder = family_dirs(request.param)
    return request.param, folder, load_model(str(folder), dtype="float32"), hf_model(folder)


def prompts(loaded) -> list[list[int]]:
    """Two plain prompts (BOS as the tokenizer adds it) and one chat prompt; the last plain one is long
    enough (~50+ tokens) that llama3's scaled frequencies (original 32 positions) matter."""
    tok = loaded.tokenizer
    return [tok.encode(TEXTS[0]), tok.encode_chat(CHAT), tok.encode(TEXTS[1] + " " + TEXTS[2])]


def full_logits(loaded, ids: list[int]) -> torch.Tensor:
    m = loaded.model
    cache = KVCache.allocate(loaded.config.kv_layout(1, len(ids), "float32"))
    return m.head(m.run_layers(m.embed(ids), range(loaded.config.num_layers), cache, [0], [0]))[0]


def test_folders_are_sharded_with_an_index(family):
    name, folder, loaded, _ = family
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert loaded.config.architecture == FAMILIES[name].model_type


def test_logits_match_transformers_on_three_prompts(family):
    _, _, loaded, hf = family
    for ids in prompts(loaded):
        expected = hf_logits(hf, ids)
        got = full_logits(loaded, ids)
        assert got.shape == expected.shape
        assert (got - expected).abs().max().item() < 1e-4, ids


def test_32_greedy_tokens_match_transformers(family):
    _, _, loaded, hf = family
    seen: set[int] = set()
    for ids in prompts(loaded):
        cache = KVCache.allocate(loaded.config.kv_layout(1, MAX_LEN, "float32"))
        ours = greedy_tokens(loaded.model, cache, 0, ids, 32)
        assert ours == hf_greedy(hf, ids, 32)
        seen.update(ours)
    assert len(seen) > 8  # not one repeated token: the comparison means something


def test_chunked_prefill_equals_one_shot(family):
    _, _, loaded, _ = family
    ids = prompts(loaded)[2]
    m, layout = loaded.model, loaded.config.kv_layout(2, MAX_LEN, "float32")
    whole, chunked, pieces = KVCache.allocate(layout), KVCache.allocate(layout), KVCache.allocate(layout)
    expected = m.prefill(ids, whole, 1)
    seen = []
    got = m.prefill(ids, chunked, 1, layers_per_chunk=1, on_chunk=seen.append)
    assert seen == [range(i, i + 1) for i in range(loaded.config.num_layers)]
    assert torch.equal(got, expected) and torch.equal(chunked.tensor, whole.tensor)
    # The prompt in token chunks (prefill continued from a cached prefix) gives the same last logits.
    layers = range(loaded.config.num_layers)
    for start in range(0, len(ids), 7):
        hidden = m.run_layers(m.embed(ids[start : start + 7]), layers, pieces, [1], [start])
    assert torch.allclose(m.head(hidden[0, -1]), expected, atol=1e-5)


def test_batched_decode_equals_each_alone(family):
    _, _, loaded, _ = family
    m, tok = loaded.model, loaded.tokenizer
    batch = [tok.encode(t) for t in ("Paris", "The quick brown fox", "12345 and", "a language model predicts")]
    alone = [greedy_tokens(m, KVCache.allocate(loaded.config.kv_layout(1, 64, "float32")), 0, p, 10) for p in batch]
    cache = KVCache.allocate(loaded.config.kv_layout(8, 64, "float32"))
    slots = [6, 1, 2, 4]  # runs {1,2}, {4}, {6}: strided views and a masked batch
    tokens = [[int(m.prefill(p, cache, s).argmax())] for s, p in zip(slots, batch)]
    positions = [len(p) for p in batch]
    for _ in range(9):
        logits = m.decode_step(cache, slots, positions, [t[-1] for t in tokens])
        for row in range(len(slots)):
            tokens[row].append(int(logits[row].argmax()))
            positions[row] += 1
    assert tokens == alone


def test_layer_sharded_members_equal_the_whole_model(family):
    _, folder, loaded, _ = family
    cfg, ids = loaded.config, prompts(loaded)[1]
    split = cfg.num_layers // 2 + cfg.num_layers % 2
    front = load_model(str(folder), dtype="float32", layers=range(0, split))
    back = load_model(str(folder), dtype="float32", layers=range(split, cfg.num_layers))
    assert set(back.model.layers) == set(range(split, cfg.num_layers))
    first = KVCache.allocate(cfg.kv_layout(2, MAX_LEN, "float32", first_layer=0, num_layers=split))
    second = KVCache.allocate(cfg.kv_layout(2, MAX_LEN, "float32", first_layer=split))
    hidden = front.model.run_layers(front.model.embed(ids), range(0, split), first, [1], [0])
    logits = back.model.head(back.model.run_layers(hidden, range(split, cfg.num_layers), second, [1], [0]))[0]
    whole = KVCache.allocate(cfg.kv_layout(2, MAX_LEN, "float32"))
    m = loaded.model
    assert torch.allclose(
        logits, m.head(m.run_layers(m.embed(ids), range(cfg.num_layers), whole, [1], [0]))[0], atol=1e-5
    )
    assert torch.equal(first.tensor[1], whole.tensor[1, :split])
    assert torch.equal(second.tensor[1], whole.tensor[1, split:])


def test_weight_names_shapes_and_parameter_count_are_transformers(family):
    _, _, loaded, hf = family
    expected = {name: tuple(p.shape) for name, p in hf.named_parameters()}  # a tied head appears once
    assert weight_shapes(loaded.config) == expected
    assert parameter_count(loaded.config) == hf.num_parameters()


def test_tokenizer_chat_template_and_eos_match_transformers(family):
    import transformers

    name, folder, loaded, _ = family
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    ours = loaded.tokenizer
    for text in [*TEXTS, "e\u0301 composed to é (NFC)", "<|im_start|>user\nhi<|im_end|>"]:
        assert ours.encode(text) == hf_tok.encode(text), text
    assert ours.encode_chat(CHAT) == list(
        hf_tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    )
    gen = json.loads((folder / "generation_config.json").read_text())
    eos = gen["eos_token_id"] if isinstance(gen["eos_token_id"], list) else [gen["eos_token_id"]]
    assert set(eos) <= set(ours.eos_token_ids)
    assert hf_tok.convert_tokens_to_ids(FAMILIES[name].eos) in ours.eos_token_ids
    assert loaded.generation.sampling_defaults() == {
        k: v for k, v in FAMILIES[name].sampling.items() if k in ("temperature", "top_p", "top_k", "repetition_penalty")
    }


def test_qwen3_template_passes_enable_thinking(family_dirs):
    tok = Tokenizer.from_dir(family_dirs("qwen3"))
    assert tok.apply_chat_template(CHAT).endswith("<|im_start|>assistant\n")
    assert tok.apply_chat_template(CHAT, enable_thinking=False).endswith("<think>\n\n</think>\n\n")


# ---- variants: rope scaling, sliding windows, biases ---------------------------------------------------


VARIANTS = {
    # Qwen2.5's long-context recipe: static YaRN x4 over the original context (positions past 32 here).
    "qwen2-yarn": (
        "qwen2",
        dict(
            max_position_embeddings=32,
            rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
        ),
    ),
    "qwen3-yarn-betas": (
        "qwen3",
        dict(
            max_position_embeddings=48,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 2.5,
                "original_max_position_embeddings": 48,
                "beta_fast": 16,
                "beta_slow": 2,
            },
        ),
    ),
    "llama-dynamic": ("llama3", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
    "llama-linear": ("llama3", dict(rope_scaling={"rope_type": "linear", "factor": 3.0})),
    "llama-attention-bias": ("llama3", dict(attention_bias=True, rope_scaling=None)),
    "qwen3-attention-bias": ("qwen3", dict(attention_bias=True)),
    "qwen3-untied": ("qwen3", dict(tie_word_embeddings=False)),
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True)),
    "mistral-v0.1-window": ("mistral", dict(sliding_window=4096)),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_logits_match_transformers(tmp_path, variant):
    name, overrides = VARIANTS[variant]
    folder = build_family(name, tmp_path, seed=11, **overrides)
    ours = load_model(str(folder), dtype="float32")
    hf = hf_model(folder)
    ids = (ours.tokenizer.encode(TEXTS[2]) * 3)[:100]
    assert (full_logits(ours, ids) - hf_logits(hf, ids)).abs().max().item() < 1e-4
    cache = KVCache.allocate(ours.config.kv_layout(1, 56, "float32"))
    assert greedy_tokens(ours.model, cache, 0, ids[:40], 16) == hf_greedy(hf, ids[:40], 16)


def test_yarn_serves_the_original_context_times_the_factor(tmp_path):
    folder = build_family("qwen2", tmp_path, **VARIANTS["qwen2-yarn"][1])
    config = load_model(str(folder), dtype="float32").config
    assert config.max_position_embeddings == 128
    config.kv_layout(1, 128, "float32")
    with pytest.raises(ValueError, match="max_position_embeddings 128"):
        config.kv_layout(1, 129, "float32")


def test_dynamic_rope_is_refused_beyond_its_original_length(tmp_path):
    folder = build_family("llama3", tmp_path, **VARIANTS["llama-dynamic"][1])
    config = load_model(str(folder), dtype="float32").config
    config.kv_layout(1, 256, "float32")
    with pytest.raises(ValueError, match="'dynamic' recomputes"):
        config.kv_layout(1, 257, "float32")


def test_qwen2_sliding_window_is_exact_up_to_the_window_and_refused_beyond(tmp_path):
    """use_sliding_window on layers from max_window_layers: equal to transformers' sliding-window
    attention while the context fits the window; a longer max_len is refused naming the field."""
    folder = build_family("qwen2", tmp_path, use_sliding_window=True, sliding_window=24, max_window_layers=1)
    ours, hf = load_model(str(folder), dtype="float32"), hf_model(folder)
    assert ours.config.sliding_window == 24
    assert hf.config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    ids = ours.tokenizer.encode(TEXTS[2])[:24]
    assert (full_logits(ours, ids) - hf_logits(hf, ids)).abs().max().item() < 1e-4
    ours.config.kv_layout(1, 24, "float32")
    with pytest.raises(ValueError, match="sliding_window 24 .*use_sliding_window=true"):
        ours.config.kv_layout(1, 25, "float32")
    # Proof that the refusal is needed: past the window transformers' answer differs from full attention.
    longer = ours.tokenizer.encode(TEXTS[2])[:40]
    unbounded = load_model(str(folder), dtype="float32").model
    cache = KVCache.allocate(
        ModelConfig(**{**ours.config.to_dict(), "sliding_window": None}).kv_layout(1, 40, "float32")
    )
    full = unbounded.head(unbounded.run_layers(unbounded.embed(longer), range(3), cache, [0], [0]))[0]
    assert (full - hf_logits(hf, longer)).abs().max().item() > 1e-3


def test_sliding_window_configured_but_off_is_full_attention(family_dirs):
    """DeepSeek-R1-Distill-Qwen ships sliding_window=4096 with use_sliding_window=false: no limit."""
    config = load_model(str(family_dirs("r1-distill-qwen")), dtype="float32").config
    assert config.sliding_window is None
    config.kv_layout(1, 256, "float32")


def test_logprobs_are_transformers_log_softmax_for_every_token(family):
    """#31: each generated token's logprob and top-5 alternatives, as the engine reports them
    (prefill's first token, decode's others), are the log-softmax of transformers' logits at
    that position, and a seeded sampled request reports the values of its own draws."""
    from pdserve_worker.model.engine import generate
    from pdserve_worker.model.sampling.params import SamplingParams

    _, _, loaded, hf = family
    ids = prompts(loaded)[0]
    for params in (
        SamplingParams(max_tokens=6, temperature=0, logprobs=5, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=1.3, seed=7, logprobs=5, ignore_eos=True),
    ):
        [done] = generate(loaded.model, loaded.tokenizer, [ids], params, max_len=MAX_LEN)
        assert len(done.logprobs) == len(done.output_ids) == 6
        reference = torch.log_softmax(hf_logits(hf, ids + done.output_ids[:-1]), dim=-1)[len(ids) - 1 :]
        for position, (token, entry) in enumerate(zip(done.output_ids, done.logprobs, strict=True)):
            expected = reference[position]
            assert entry.logprob == pytest.approx(float(expected[token]), abs=1e-4)
            values, top_ids = torch.topk(expected, 5)
            assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-4)
            assert {i for i, _ in entry.top} == set(top_ids.tolist()) or torch.unique(values).numel() < 5


def test_prompt_logprobs_are_transformers_log_softmax_of_each_prompt_token(family, monkeypatch):
    """#31 echo: prompt token i's logprob is the log-softmax of transformers' logits at i-1 (no
    processors), top-3 likewise; computed from the prefill's own final states, the head over a
    few positions at a time (16 here, so every prompt spans more than one run)."""
    from pdserve_worker.model.engine import generate
    from pdserve_worker.model.sampling import sampler
    from pdserve_worker.model.sampling.params import SamplingParams

    monkeypatch.setattr(sampler, "PROMPT_LOGPROB_ROWS", 16)

    _, _, loaded, hf = family
    ids = prompts(loaded)[2]
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=3, prompt_logprobs=3, repetition_penalty=1.5)
    [done] = generate(loaded.model, loaded.tokenizer, [ids], params, max_len=MAX_LEN)
    expected = torch.log_softmax(hf_logits(hf, ids), dim=-1)
    assert done.prompt_logprobs is not None and len(done.prompt_logprobs) == len(ids) - 1 > 16
    for position, entry in enumerate(done.prompt_logprobs, start=1):
        assert entry.logprob == pytest.approx(float(expected[position - 1, ids[position]]), abs=1e-4)
        assert [v for _, v in entry.top] == pytest.approx(
            torch.topk(expected[position - 1], 3).values.tolist(), abs=1e-4
        )
