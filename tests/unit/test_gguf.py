"""GGUF reading on a tiny llama.cpp-style file: Q/K unpermutation, quantized tensors, tokenizer
metadata, and the conversion cache (atomic, keyed, race-safe)."""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve_worker.kv.cache import KVCache
from pdserve_worker.model.loading.convert import MARKER, converted_gguf
from pdserve_worker.model.loading.loader import load_model
from pdserve_worker.model.loading.random_model import tiny_config, tiny_weights
from pdserve_worker.model.loading.weights import permute_qk, read_gguf, unpermute_qk
from pdserve_worker.model.tokenizer import Tokenizer
from support.tiny_model import write_tiny_gguf, write_tiny_model

SAMPLES = ["Paris is the capital of France.", "12345 café 🙂 東京", "<|im_start|>user\nhi<|im_end|>"]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", seed=5)


@settings(max_examples=30, deadline=None)
@given(heads=st.integers(1, 4), half=st.integers(1, 4), cols=st.integers(1, 3))
def test_unpermute_inverts_llama_cpp_permutation(heads, half, cols):
    w = torch.arange(heads * half * 2 * cols, dtype=torch.float32).reshape(heads * half * 2, cols)
    permuted = permute_qk(w, heads)
    assert torch.equal(unpermute_qk(permuted, heads), w)
    if half > 1:
        assert not torch.equal(permuted, w)


def test_read_gguf_gives_the_original_weights_under_hf_names(tiny_gguf):
    ckpt = read_gguf(tiny_gguf)
    expected = tiny_weights(tiny_config(ckpt.config.vocab_size), seed=5)
    assert set(ckpt.tensors) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(ckpt.tensors[name], tensor), name
    assert ckpt.config.num_kv_heads == 2 and not ckpt.config.tie_word_embeddings


def test_quantized_tensors_are_dequantized(tmp_path):
    path = write_tiny_gguf(tmp_path / "q.gguf", seed=5, quantized=("blk.0.ffn_up.weight", "blk.1.attn_q.weight"))
    ckpt = read_gguf(path)
    expected = tiny_weights(tiny_config(ckpt.config.vocab_size), seed=5)
    for name in ("model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.q_proj.weight"):
        got, want = ckpt.tensors[name], expected[name]
        assert not torch.equal(got, want)  # Q8_0 is lossy...
        assert (got - want).abs().max() <= want.abs().max() / 127 + 1e-6  # ...by at most one step


def test_model_from_gguf_equals_model_from_hf_folder(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    from_gguf = load_model(str(tiny_gguf), dtype="float32")
    assert from_gguf.name == "tiny"
    ids = from_gguf.tokenizer.encode(SAMPLES[0])
    from_hf = load_model(str(write_tiny_model(tmp_path / "hf", seed=5)), dtype="float32")
    layout = from_hf.config.kv_layout(1, 64, "float32")
    a = from_gguf.model.prefill(ids, KVCache.allocate(layout), 0)
    b = from_hf.model.prefill(ids, KVCache.allocate(layout), 0)
    assert torch.allclose(a, b, atol=1e-5)


def test_tokenizer_from_gguf_metadata_equals_the_original(tiny_gguf, tiny_model_dir):
    ours = Tokenizer.from_gguf_metadata(read_gguf(tiny_gguf).metadata)
    original = Tokenizer.from_dir(tiny_model_dir)
    for text in SAMPLES:
        assert ours.encode(text) == original.encode(text)
        assert ours.decode(ours.encode(text)) == text
    conv = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(conv) == original.apply_chat_template(conv)
    # llama.cpp ends generation on the metadata's eos and on <|endoftext|> by its text (EOG detection).
    ids = original.backend.token_to_id
    assert ours.eos_token_ids == (ids("<|im_end|>"), ids("<|endoftext|>")) and original.eos_token_ids == (
        ids("<|im_end|>"),
    )


def test_conversion_is_cached_per_file_identity_and_dtype(tiny_gguf, tmp_path):
    root = tmp_path / "cache"
    fp32 = converted_gguf(tiny_gguf, "float32", root)
    marker_time = (fp32 / MARKER).stat().st_mtime_ns
    assert converted_gguf(tiny_gguf, "float32", root) == fp32
    assert (fp32 / MARKER).stat().st_mtime_ns == marker_time  # not rebuilt
    bf16 = converted_gguf(tiny_gguf, "bfloat16", root)
    assert bf16 != fp32 and json.loads((bf16 / "config.json").read_text())["torch_dtype"] == "bfloat16"
    st = tiny_gguf.stat()
    os.utime(tiny_gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert converted_gguf(tiny_gguf, "float32", root) != fp32  # a modified file is a new entry
    with pytest.raises(ValueError, match="int4"):
        converted_gguf(tiny_gguf, "int4", root)


def test_racing_conversions_publish_one_complete_folder(tiny_gguf, tmp_path):
    root = tmp_path / "race"
    barrier = threading.Barrier(3)
    results, errors = [], []

    def convert() -> None:
        barrier.wait()
        try:
            results.append(converted_gguf(tiny_gguf, "bfloat16", root))
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=convert) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(".")) == []  # no temp folders left
    assert (results[0].stat().st_mode & 0o777) == 0o755
    assert load_model(str(results[0]), dtype="bfloat16").config.num_layers == 4
