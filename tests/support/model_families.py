"""Tiny random-weight models of each family the engine serves, made by transformers itself.

Every builder here takes the structure of a real published checkpoint (GQA ratio, q/k/v bias,
q/k norm, explicit head_dim, tied or untied head, rope scaling, special tokens, chat template,
generation_config.json) and shrinks only the sizes (hidden 64-96, 2-3 layers, a few hundred
tokens of vocabulary). The model is built by transformers from its own config class and saved
with `save_pretrained` as sharded safetensors with an index, so the folder is exactly what
transformers writes; the tokenizer is trained here with the `tokenizers` library in the
family's pipeline (Qwen2's is transformers' own `Qwen2Tokenizer` pipeline). Nothing comes from
a model hub.

`write_family_gguf` writes the same model as llama.cpp's converter would (tensor names from
the `gguf` package's `TensorNameMap`, the metadata keys of `TextModel.set_gguf_parameters`,
the vocabulary as `get_vocab_base` pads it, merges/special ids/chat template by
`gguf.SpecialVocab`), for the qwen2 and qwen3 architectures.

Shared by the unit and integration tests through conftest's session fixtures, so each family
is built once per session (well under a second each).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

# ---- tokenizers -------------------------------------------------------------------------------

CORPUS = (
    "The quick brown fox jumps over the lazy dog. ",
    "Paris is the capital of France, and Berlin is the capital of Germany. ",
    "A language model predicts the next token from the tokens before it. ",
    "Prefill computes the cache of a prompt; decode reads it and writes one token at a time. ",
    "Numbers like 12345 and 2048 are split into digits. I'm sure you'll like it, we've seen it. ",
    "Unicode text: café, naïve, 東京, 北京是中国的首都, 🙂 and ∑ survive a round trip.\n\nNew lines too.\n",
)
# Qwen2's pre-tokenizer regex (transformers' tokenization_qwen2.PRETOKENIZE_REGEX).
QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level_bpe(regex: str, specials: list[str], nfc: bool, vocab_size: int = 400) -> Tokenizer:
    """A byte-level BPE with a regex split (Qwen2, Llama 3); special tokens get the ids after the BPE
    vocabulary, as in the real files (Qwen's <|endoftext|> is 151643, Llama 3's <|begin_of_text|> 128000)."""
    tok = Tokenizer(models.BPE())
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator([line * 8 for line in CORPUS], trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return tok


def _sentencepiece_bpe(specials: list[str], vocab_size: int = 400) -> Tokenizer:
    """A Llama-2/Mistral style BPE: `▁` for spaces, byte fallback `<0xXX>` tokens, `<s>` added in front."""
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False)
    trained.train_from_iterator([line * 8 for line in CORPUS], trainer=trainer)
    state = json.loads(trained.to_str())["model"]
    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)])}
    for token in sorted(state["vocab"], key=state["vocab"].get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in state["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ["<unk>", "<s>", "</s>", *specials]])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    return tok


# ---- chat templates (the real ones' structure, tools left out) ----------------------------------

QWEN25_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
QWEN3_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
MISTRAL_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{- '[INST] ' + message['content'] + '[/INST]' }}"
    "{%- elif message['role'] == 'assistant' %}{{- message['content'] + eos_token }}{%- endif %}"
    "{%- endfor %}"
)
R1_DISTILL_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{- '<｜User｜>' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' %}{{- '<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<｜Assistant｜><think>\\n' }}{%- endif %}"
)


# ---- the families ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Family:
    """A published checkpoint's structure at toy size."""

    name: str
    model_type: str
    like: str  # the real checkpoint whose structure this copies
    config: dict[str, Any]  # transformers config kwargs (sizes shrunk)
    tokenizer: str  # "qwen2" | "llama3" | "sentencepiece"
    specials: tuple[str, ...]
    bos: str | None
    eos: str
    chat_template: str
    tokenizer_class: str = "PreTrainedTokenizerFast"
    eos_ids: tuple[str, ...] = ()  # generation_config.json eos_token_id (token strings)
    sampling: dict[str, Any] = field(default_factory=dict)  # generation_config.json sampling defaults
    vocab_padding: int = 0  # rows past the tokenizer (Qwen pads 151665 tokens to 152064 rows)


QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
FAMILIES: dict[str, Family] = {
    # Qwen2.5-7B-Instruct: 28 heads over 4 KV heads, q/k/v bias, untied, theta 1e6, ChatML.
    "qwen2": Family(
        name="qwen2",
        model_type="qwen2",
        like="Qwen/Qwen2.5-7B-Instruct",
        config=dict(
            hidden_size=96,
            intermediate_size=224,
            num_hidden_layers=3,
            num_attention_heads=6,
            num_key_value_heads=2,
            max_position_embeddings=256,
            rope_theta=1_000_000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            use_sliding_window=False,
            sliding_window=131072,
            max_window_layers=28,
        ),
        tokenizer="qwen2",
        specials=QWEN_SPECIALS,
        bos=None,
        eos="<|im_end|>",
        chat_template=QWEN25_TEMPLATE,
        tokenizer_class="Qwen2Tokenizer",
        eos_ids=("<|im_end|>", "<|endoftext|>"),
        sampling=dict(do_sample=True, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05),
        vocab_padding=9,
    ),
    # Qwen3-0.6B: explicit head_dim (16 x 128 > hidden 1024), q/k RMSNorm, no bias, tied head.
    "qwen3": Family(
        name="qwen3",
        model_type="qwen3",
        like="Qwen/Qwen3-0.6B",
        config=dict(
            hidden_size=64,
            intermediate_size=192,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            max_position_embeddings=256,
            rope_theta=1_000_000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            attention_bias=False,
            use_sliding_window=False,
        ),
        tokenizer="qwen2",
        specials=(*QWEN_SPECIALS, "<think>", "</think>"),
        bos=None,
        eos="<|im_end|>",
        chat_template=QWEN3_TEMPLATE,
        tokenizer_class="Qwen2Tokenizer",
        eos_ids=("<|im_end|>", "<|endoftext|>"),
        sampling=dict(do_sample=True, temperature=0.6, top_p=0.95, top_k=20),
        vocab_padding=4,
    ),
    # DeepSeek-R1-Distill-Qwen-1.5B: a qwen2 model (sliding window configured but off), its own
    # fullwidth special tokens, BOS added by the template, eos <｜end▁of▁sentence｜>.
    "r1-distill-qwen": Family(
        name="r1-distill-qwen",
        model_type="qwen2",
        like="deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B",
        config=dict(
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            rope_theta=10000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            use_sliding_window=False,
            sliding_window=4096,
            max_window_layers=21,
        ),
        tokenizer="qwen2",
        specials=(
            "<｜begin▁of▁sentence｜>",
            "<｜end▁of▁sentence｜>",
            "<｜User｜>",
            "<｜Assistant｜>",
            "<think>",
            "</think>",
        ),
        bos="<｜begin▁of▁sentence｜>",
        eos="<｜end▁of▁sentence｜>",
        chat_template=R1_DISTILL_TEMPLATE,
        eos_ids=("<｜end▁of▁sentence｜>",),
        sampling=dict(do_sample=True, temperature=0.6, top_p=0.95),
    ),
    # Llama-3.1-8B-Instruct: 4 query heads per KV head, llama3 rope scaling, theta 5e5, untied.
    "llama3": Family(
        name="llama3",
        model_type="llama",
        like="meta-llama/Llama-3.1-8B-Instruct",
        config=dict(
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            max_position_embeddings=256,
            rope_theta=500000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        ),
        tokenizer="llama3",
        specials=(
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eom_id|>",
            "<|eot_id|>",
        ),
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        chat_template=LLAMA3_TEMPLATE,
        eos_ids=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
        sampling=dict(do_sample=True, temperature=0.6, top_p=0.9),
    ),
    # Mistral-7B-Instruct-v0.3: sentencepiece-style BPE with byte fallback, [INST] template, no window.
    "mistral": Family(
        name="mistral",
        model_type="mistral",
        like="mistralai/Mistral-7B-Instruct-v0.3",
        config=dict(
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            rope_theta=1_000_000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            sliding_window=None,
        ),
        tokenizer="sentencepiece",
        specials=("[INST]", "[/INST]"),
        bos="<s>",
        eos="</s>",
        chat_template=MISTRAL_TEMPLATE,
        eos_ids=("</s>",),
    ),
}


def build_tokenizer(family: Family) -> Tokenizer:
    if family.tokenizer == "qwen2":
        return _byte_level_bpe(QWEN2_REGEX, list(family.specials), nfc=True)
    if family.tokenizer == "llama3":
        tok = _byte_level_bpe(LLAMA3_REGEX, list(family.specials), nfc=False)
        bos = tok.token_to_id(family.bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{family.bos} $A", pair=f"{family.bos} $A {family.bos} $B", special_tokens=[(family.bos, bos)]
        )
        return tok
    return _sentencepiece_bpe(list(family.specials))


def _reinitialize(model: torch.nn.Module, seed: int) -> None:
    """Weights scaled so activations and logits stay O(1) through every layer (transformers' own init,
    std 0.02, gives near-zero logits whose greedy choices are coin flips)."""
    gen = torch.Generator().manual_seed(seed)
    embed_scale = 0.05 if getattr(model.config, "tie_word_embeddings", False) else 0.3
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                # Small next to the layers' outputs: with a tied head, a dominant embedding makes every
                # token predict itself.
                p.copy_(embed_scale * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)


def build_family(name: str, folder: str | Path, seed: int = 0, shard_kb: int = 64, **config: Any) -> Path:
    """Write family `name`'s tiny model (sharded safetensors, tokenizer, chat template,
    generation_config.json) into `folder` with transformers; `config` overrides the family's kwargs."""
    import transformers

    family = FAMILIES[name]
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(family)
    ids = {t: tok.token_to_id(t) for t in family.specials + ("<s>", "</s>") if tok.token_to_id(t) is not None}
    kwargs = {**family.config, **config}
    kwargs.setdefault("vocab_size", tok.get_vocab_size(with_added_tokens=True) + family.vocab_padding)
    kwargs.setdefault("bos_token_id", ids.get(family.bos) if family.bos else None)
    kwargs.setdefault("eos_token_id", ids[family.eos])
    hf_config = transformers.AutoConfig.for_model(family.model_type, **kwargs)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    _reinitialize(model, seed)
    model.save_pretrained(out, max_shard_size=f"{shard_kb}KB")
    tok.save(str(out / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": family.tokenizer_class,
        "eos_token": family.eos,
        "bos_token": family.bos,
        "chat_template": family.chat_template,
        "clean_up_tokenization_spaces": False,
        "model_max_length": kwargs["max_position_embeddings"],
    }
    if family.tokenizer_class == "Qwen2Tokenizer":
        tok_cfg.update(pad_token="<|endoftext|>", unk_token=None)
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False))
    gen = {
        "bos_token_id": kwargs["bos_token_id"],
        "eos_token_id": [ids[t] for t in family.eos_ids] or kwargs["eos_token_id"],
        **family.sampling,
    }
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return out


def hf_model(folder: str | Path):
    """transformers' model of a folder, float32, eval mode (the reference)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    return model.eval()


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits `[len(ids), vocab]` of one plain forward (no cache)."""
    return model(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def hf_greedy(model, ids: list[int], count: int) -> list[int]:
    """`count` greedy tokens, each from a full forward over everything so far (no cache, no stop)."""
    seq = list(ids)
    for _ in range(count):
        seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids) :]


# ---- GGUF, the way llama.cpp's converter writes it -----------------------------------------------------


def write_family_gguf(folder: str | Path, path: str | Path, quantized: tuple[str, ...] = ()) -> Path:
    """The HF folder `folder` (a qwen2 or qwen3 family model) as a llama.cpp GGUF file.

    Tensors F32 (Q8_0 for the GGUF names in `quantized`), stored unpermuted (NEOX rope).
    """
    import gguf
    import numpy as np
    import transformers

    folder, out = Path(folder), Path(path)
    hp = json.loads((folder / "config.json").read_text())
    arch = {"qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3}[hp["model_type"]]
    writer = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    # TextModel.set_gguf_parameters
    writer.add_block_count(hp["num_hidden_layers"])
    writer.add_context_length(hp["max_position_embeddings"])
    writer.add_embedding_length(hp["hidden_size"])
    writer.add_feed_forward_length(hp["intermediate_size"])
    writer.add_head_count(hp["num_attention_heads"])
    writer.add_head_count_kv(hp["num_key_value_heads"])
    rope = hp.get("rope_parameters") or hp.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type")) == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_rope_freq_base(rope.get("rope_theta", hp.get("rope_theta")))
    writer.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    if hp.get("head_dim") is not None:
        writer.add_key_length(hp["head_dim"])
        writer.add_value_length(hp["head_dim"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    # TextModel.get_vocab_base + _set_vocab_gpt2: one entry per embedding row, [PADn] past the tokenizer.
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    reverse = {i: t for t, i in tok.get_vocab().items()}
    added = tok.get_added_vocab()
    tokens, types = [], []
    for i in range(hp["vocab_size"]):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif reverse[i] in added:
            tokens.append(reverse[i])
            types.append(gguf.TokenType.CONTROL if tok.added_tokens_decoder[i].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(reverse[i])
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(folder, load_merges=True).add_to_gguf(writer)
    # Tensors, renamed by the gguf package's map (llama.cpp's ModelBase.map_tensor_name).
    names = gguf.get_tensor_name_map(arch, hp["num_hidden_layers"])
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and hp.get("tie_word_embeddings"):
            continue  # llama.cpp writes no output.weight for a tied head
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"gguf has no name for {hf_name}")
        array = tensor.numpy().astype(np.float32)
        if name in quantized:
            writer.add_tensor(
                name,
                gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0),
                raw_dtype=gguf.GGMLQuantizationType.Q8_0,
            )
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
