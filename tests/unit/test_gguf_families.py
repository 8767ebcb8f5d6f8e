"""qwen2 and qwen3 GGUF files, written as llama.cpp's converter writes them, load and equal the HF model.

The files come from tests/support/model_families.py `write_family_gguf`: tensor names by the `gguf`
package's TensorNameMap, metadata by GGUFWriter's own keys, vocabulary padded with [PADn]
like `get_vocab_base`, merges/special ids/template by `gguf.SpecialVocab`. The reference is
transformers running the HF folder the file was made from; for qwen2 transformers' own GGUF
reader loads the same file and agrees (a check on the writer, not on us).
"""

from __future__ import annotations

import gguf
import pytest
import torch

from pdserve_worker.kv.cache import KVCache
from pdserve_worker.model.engine import greedy_tokens
from pdserve_worker.model.loading.gguf_format import config_from_gguf, gguf_to_hf_name, hf_to_gguf_name
from pdserve_worker.model.loading.loader import load_model
from pdserve_worker.model.loading.weights import read_gguf, read_gguf_metadata
from pdserve_worker.model.shapes import weight_shapes
from pdserve_worker.model.tokenizer import Tokenizer
from support.model_families import build_family, hf_greedy, hf_logits, hf_model, write_family_gguf

TEXTS = ["Paris is the capital of France.", "12345 café 東京 🙂\n\nnew lines", "<|im_start|>user\nhi<|im_end|>\n"]


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def gguf_model(request, family_dirs, tmp_path_factory):
    """(family, HF folder, GGUF path)."""
    folder = family_dirs(request.param)
    path = write_family_gguf(folder, tmp_path_factory.mktemp("gguf") / f"tiny-{request.param}.gguf")
    return request.param, folder, path


def logits(loaded, ids):
    m = loaded.model
    cache = KVCache.allocate(loaded.config.kv_layout(1, len(ids), "float32"))
    return m.head(m.run_layers(m.embed(ids), range(loaded.config.num_layers), cache, [0], [0]))[0]


@pytest.mark.parametrize("arch", [gguf.MODEL_ARCH.LLAMA, gguf.MODEL_ARCH.QWEN2, gguf.MODEL_ARCH.QWEN3])
def test_tensor_names_are_the_gguf_packages(arch, family_dirs):
    """Our GGUF<->HF table against gguf's TensorNameMap and the tensors llama.cpp declares per architecture."""
    name = {gguf.MODEL_ARCH.LLAMA: "llama3", gguf.MODEL_ARCH.QWEN2: "qwen2", gguf.MODEL_ARCH.QWEN3: "qwen3"}[arch]
    config = load_model(str(family_dirs(name)), dtype="float32").config
    names = gguf.get_tensor_name_map(arch, config.num_layers)
    declared = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[arch]}
    for hf_name in weight_shapes(config):
        expected = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert hf_to_gguf_name(hf_name) == expected, hf_name
        assert gguf_to_hf_name(expected) == hf_name
        base = expected.rsplit(".", 1)[0].replace(".0.", ".{bid}.").replace(".1.", ".{bid}.").replace(".2.", ".{bid}.")
        assert base in declared, base


def test_gguf_loads_and_equals_the_hf_model(gguf_model, tmp_path, monkeypatch):
    name, folder, path = gguf_model
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    ours = load_model(str(path), dtype="float32")
    hf = hf_model(folder)
    assert ours.config.architecture == name
    assert ours.name == path.stem
    for text in TEXTS:
        ids = ours.tokenizer.encode(text)
        assert (logits(ours, ids) - hf_logits(hf, ids)).abs().max().item() < 1e-4
    ids = ours.tokenizer.encode(TEXTS[0])
    cache = KVCache.allocate(ours.config.kv_layout(1, 64, "float32"))
    assert greedy_tokens(ours.model, cache, 0, ids, 32) == hf_greedy(hf, ids, 32)
    assert set(ours.tokenizer.eos_token_ids) == set(
        ours.tokenizer.backend.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>")
    )
    # The converted folder is a plain HF folder transformers loads as the same model.
    converted = hf_model(tmp_path / "cache" / next(p.name for p in (tmp_path / "cache").iterdir()))
    assert (hf_logits(converted, ids) - hf_logits(hf, ids)).abs().max().item() < 1e-5


def test_gguf_config_and_tokenizer_are_the_folders(gguf_model):
    import transformers

    name, folder, path = gguf_model
    ckpt = read_gguf(path)
    hf_loaded = load_model(str(folder), dtype="float32")
    expected, got = hf_loaded.config, ckpt.config
    for field in (
        "vocab_size",  # (GGUF floats are float32) "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
        "head_dim",
        "rope_theta",
        "rms_norm_eps",
        "max_position_embeddings",
        "tie_word_embeddings",
        "qkv_bias",
        "o_bias",
        "qk_norm",
        "architecture",
    ):
        want = getattr(expected, field)
        assert getattr(got, field) == (pytest.approx(want, rel=1e-6) if isinstance(want, float) else want), field
    meta = ckpt.metadata
    assert len(meta["tokenizer.ggml.tokens"]) == expected.vocab_size  # padded with [PADn] like llama.cpp
    ours = Tokenizer.from_gguf_metadata(meta)
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    for text in TEXTS:  # NFC text: llama.cpp does not normalize, Qwen2Tokenizer does
        assert ours.encode(text) == hf_tok.encode(text), text
        assert ours.decode(ours.encode(text)) == text
    chat = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat) == hf_loaded.tokenizer.apply_chat_template(chat)
    # llama.cpp's end of generation: the eos id, and <|endoftext|> by its text (llama_vocab EOG detection).
    assert ours.eos_token_ids == tuple(hf_tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]))


def test_transformers_reads_the_qwen2_file_as_the_same_model(family_dirs, tmp_path):
    """transformers' GGUF reader on our test file: the writer follows the conventions upstream reads.
    (qwen3 is not checked this way: transformers' reader ignores qwen3.attention.key_length.)"""
    import transformers

    folder = family_dirs("qwen2")
    write_family_gguf(folder, tmp_path / "m.gguf")
    from_gguf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="m.gguf", dtype=torch.float32
    ).eval()
    ids = [5, 17, 300, 42, 9]
    assert (hf_logits(from_gguf, ids) - hf_logits(hf_model(folder), ids)).abs().max().item() < 1e-6


def test_quantized_qwen2_tensors_dequantize_and_biases_stay_exact(family_dirs, tmp_path):
    folder = family_dirs("qwen2")
    path = write_family_gguf(folder, tmp_path / "q.gguf", quantized=("blk.0.attn_q.weight", "blk.1.ffn_up.weight"))
    ckpt = read_gguf(path)
    reference = hf_model(folder).state_dict()
    for hf_name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight"):
        got, want = ckpt.tensors[hf_name], reference[hf_name]
        assert not torch.equal(got, want)
        assert (got - want).abs().max() <= want.abs().max() / 127 + 1e-6  # Q8_0: one step at most
    assert torch.equal(
        ckpt.tensors["model.layers.0.self_attn.q_proj.bias"], reference["model.layers.0.self_attn.q_proj.bias"]
    )


def test_yarn_metadata_round_trips(tmp_path, monkeypatch):
    """Qwen2.5 with YaRN: llama.cpp's rope.scaling keys back to HF's rope_scaling, same logits."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    folder = build_family(
        "qwen2",
        tmp_path / "hf",
        seed=4,
        max_position_embeddings=32,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    )
    path = write_family_gguf(folder, tmp_path / "yarn.gguf")
    meta, _ = read_gguf_metadata(path)
    assert meta["qwen2.rope.scaling.type"] == "yarn" and meta["qwen2.rope.scaling.original_context_length"] == 32
    ours = load_model(str(path), dtype="float32")
    assert ours.config.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    assert ours.config.max_position_embeddings == 128
    ids = (ours.tokenizer.encode(TEXTS[0] + " " + TEXTS[1]) * 6)[:100]
    assert (logits(ours, ids) - hf_logits(hf_model(folder), ids)).abs().max().item() < 1e-4


def _meta(arch: str, **extra):
    meta = {
        "general.architecture": arch,
        f"{arch}.attention.head_count": 4,
        f"{arch}.embedding_length": 64,
        f"{arch}.context_length": 128,
        f"{arch}.feed_forward_length": 96,
        f"{arch}.block_count": 2,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{arch}.vocab_size": 100,
    }
    meta.update(extra)
    return meta


def test_gguf_refusals_name_the_key():
    with pytest.raises(ValueError, match="general.architecture 'gemma2'"):
        config_from_gguf(_meta("gemma2"), set())
    with pytest.raises(ValueError, match="qwen2 file lacks blk.0.attn_q.bias"):
        config_from_gguf(_meta("qwen2"), {"output.weight"})
    with pytest.raises(ValueError, match="qwen3 file lacks blk.0.attn_q_norm.weight"):
        config_from_gguf(_meta("qwen3"), set())
    with pytest.raises(ValueError, match="qwen2.rope.scaling.yarn_attn_factor"):
        config_from_gguf(
            _meta(
                "qwen2",
                **{
                    "qwen2.rope.scaling.type": "yarn",
                    "qwen2.rope.scaling.factor": 4.0,
                    "qwen2.rope.scaling.yarn_attn_factor": 0.8,
                },
            ),
            {"blk.0.attn_q.bias"},
        )
    with pytest.raises(ValueError, match="rope.scaling.type 'longrope'"):
        config_from_gguf(
            _meta("llama", **{"llama.rope.scaling.type": "longrope", "llama.rope.scaling.factor": 2.0}), set()
        )
    with pytest.raises(ValueError, match="lacks llama.block_count"):
        config_from_gguf({k: v for k, v in _meta("llama").items() if k != "llama.block_count"}, set())
