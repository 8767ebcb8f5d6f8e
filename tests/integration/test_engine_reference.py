"""The engine against HF transformers on the real default model (SmolLM2-135M-Instruct GGUF).

HF loads the same GGUF file itself (its own dequantization, its own tokenizer conversion), so
agreement here checks our GGUF reading, Q/K unpermutation, forward, KV cache and tokenizer
against an independent implementation. Everything runs in fp32, where greedy text must match.
"""

from __future__ import annotations

import pytest
import torch

from pdserve_worker.kv.cache import KVCache
from pdserve_worker.model.engine import Generator, greedy_tokens, prefill_first_token
from pdserve_worker.model.loading.default_model import default_model_path
from pdserve_worker.model.loading.loader import load_model
from pdserve_worker.model.sampling.params import SamplingParams

pytestmark = pytest.mark.slow

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
]
GREEDY_TOKENS = 24

TEXTS = [
    "Hello, world!",
    "  leading spaces and\ttabs\nnew lines",
    "Numbers 12345 and 3.14159, dates 2024-06-01.",
    "Ünïcödé: café naïve, 東京タワー, Привет, emoji 🙂👍🏽 and math ∑∫√",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "code: def f(x):\n    return x**2  # comment",
]


@pytest.fixture(scope="session")
def hf_reference():
    """HF's model and tokenizer loaded straight from the GGUF (slow, about 20 s): once per session."""
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    model.eval()
    return model, tok


@pytest.fixture(scope="module")
def ours(default_model_dir):
    return load_model(str(default_model_dir), dtype="float32")


def hf_greedy(model, prompt_ids: list[int], count: int) -> list[int]:
    """HF's greedy tokens through its own KV cache, past EOS (generate() would stop or suppress it)."""
    out: list[int] = []
    with torch.no_grad():
        step = model(torch.tensor([prompt_ids]), use_cache=True)
        while True:
            out.append(int(step.logits[0, -1].argmax()))
            if len(out) == count:
                return out
            step = model(torch.tensor([[out[-1]]]), past_key_values=step.past_key_values, use_cache=True)


def chat_ids(ours, text: str) -> list[int]:
    return ours.tokenizer.encode_chat([{"role": "user", "content": text}])


def test_config_read_from_gguf(ours):
    c = ours.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (
        30,
        576,
        9,
        3,
        64,
        49152,
    )
    assert c.tie_word_embeddings and c.rope_theta == 100000.0


def test_prompt_logits_match_hf(ours, hf_reference):
    hf_model, _ = hf_reference
    ids = chat_ids(ours, CHATS[0])
    cache = KVCache.allocate(ours.config.kv_layout(1, 128, "float32"))
    logits = ours.model.prefill(ids, cache, 0)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0]
    assert (logits - ref[-1]).abs().max().item() < 1e-3
    # Every position, not only the last: run the full prompt through the layers ourselves.
    full = ours.model.head(ours.model.run_layers(ours.model.embed(ids), range(30), cache, [0], [0]))[0]
    assert (full - ref).abs().max().item() < 1e-3


@pytest.mark.parametrize("text", CHATS)
def test_greedy_chat_continuation_matches_hf(ours, hf_reference, text):
    hf_model, _ = hf_reference
    ids = chat_ids(ours, text)
    cache = KVCache.allocate(ours.config.kv_layout(1, 256, "float32"))
    mine = greedy_tokens(ours.model, cache, 0, ids, GREEDY_TOKENS)
    assert mine == hf_greedy(hf_model, ids, GREEDY_TOKENS), ours.tokenizer.decode(mine)


def test_chunked_prefill_equals_one_forward(ours):
    ids = chat_ids(ours, CHATS[1])
    layout = ours.config.kv_layout(2, 128, "float32")
    whole, chunked = KVCache.allocate(layout), KVCache.allocate(layout)
    expected = ours.model.prefill(ids, whole, 1)
    seen: list[range] = []

    def on_chunk(layers: range) -> None:
        # The chunk's KV must already be final in the cache when the hook runs.
        for layer in layers:
            assert torch.equal(chunked.keys(layer)[1, : len(ids)], whole.keys(layer)[1, : len(ids)])
            assert torch.equal(chunked.values(layer)[1, : len(ids)], whole.values(layer)[1, : len(ids)])
        seen.append(layers)

    got = ours.model.prefill(ids, chunked, 1, layers_per_chunk=7, on_chunk=on_chunk)
    assert seen == [range(0, 7), range(7, 14), range(14, 21), range(21, 28), range(28, 30)]
    assert torch.equal(got, expected)
    assert torch.equal(chunked.tensor, whole.tensor)


def test_batched_decode_matches_decoding_alone(ours):
    prompts = [chat_ids(ours, t) for t in CHATS] + [ours.tokenizer.encode("Once upon a time")]
    assert len({len(p) for p in prompts}) == 4, "the test needs different prompt lengths"
    layout = ours.config.kv_layout(4, 160, "float32")
    alone = []
    for p in prompts:
        alone.append(greedy_tokens(ours.model, KVCache.allocate(ours.config.kv_layout(1, 160, "float32")), 0, p, 16))
    gen = Generator(ours.model, ours.tokenizer, KVCache.allocate(layout))
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    for slot, p in enumerate(prompts):
        request_id, out = gen.add_prefilled(
            p, slot, prefill_first_token(ours.model, gen.cache, slot, p, params), params
        )
        tokens[request_id] = [out.token_id]
    for out in gen.stream():
        tokens[out.request_id].append(out.token_id)
    assert list(tokens.values()) == alone
    assert gen.stats.decode_steps == 15 and gen.stats.decode_tokens == 4 * 15


def test_tokenizer_matches_hf(ours, hf_reference):
    _, hf_tok = hf_reference
    for text in TEXTS:
        ids = ours.tokenizer.encode(text)
        assert ids == hf_tok.encode(text), text
        assert ours.tokenizer.decode(ids) == hf_tok.decode(ids)
    messages = [
        [{"role": "user", "content": "What is 2+2?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"}],
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
    ]
    for conv in messages:
        for gen_prompt in (True, False):
            ours_text = ours.tokenizer.apply_chat_template(conv, add_generation_prompt=gen_prompt)
            hf_text = hf_tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen_prompt)
            assert ours_text == hf_text
    assert "You are a helpful AI assistant named SmolLM" in ours.tokenizer.apply_chat_template(messages[0])
    assert "SmolLM" not in ours.tokenizer.apply_chat_template(messages[1])


def test_incremental_detokenizer_equals_full_decode(ours):
    for text in TEXTS:
        ids = ours.tokenizer.encode(text)
        detok = ours.tokenizer.detokenizer(skip_special_tokens=False)
        pieces = [detok.push(i) for i in ids] + [detok.flush()]
        assert "".join(pieces) == ours.tokenizer.decode(ids)
        assert all("\ufffd" not in p for p in pieces), pieces
