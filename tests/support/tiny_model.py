"""A tiny random-weight LLaMA in HF format, for tests that need a model but not a good one.

Everything about it is real except the weights' values: an HF folder (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json with a chat template) that this
engine and transformers both load, with a byte-level BPE tokenizer trained by `tokenizers`
on a fixed corpus. Deterministic for a seed, about 1 MB, written in well under a second.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors.torch import save_file
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from pdserve_worker.model.loading.random_model import tiny_config, tiny_weights

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BOS, EOS = "<|endoftext|>", "<|im_end|>"

# ChatML with a default system prompt when the conversation has none (as SmolLM2's GGUF has).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny test model.<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = (
    "The quick brown fox jumps over the lazy dog. ",
    "Paris is the capital of France, and Berlin is the capital of Germany. ",
    "A language model predicts the next token from the tokens before it. ",
    "Prefill computes the cache of a prompt; decode reads it and writes one token at a time. ",
    "Numbers like 12345 and 2048 are split into digits. ",
    "Unicode text: café, naïve, Ünïcödé, 東京, 🙂 and ∑ survive a round trip. ",
)


def build_tiny_tokenizer(vocab_size: int = 384) -> BackendTokenizer:
    """A byte-level BPE trained on a fixed corpus (deterministic: same corpus, same merges)."""
    tok = BackendTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([line * 8 for line in _CORPUS], trainer=trainer)
    return tok


def write_tiny_model(directory: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Write the tiny model's HF folder into `directory` (created if needed) and return it.

    `overrides` are ModelConfig fields (e.g. num_layers=6, rope_scaling={...}, vocab_size=...).
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer()
    vocab = overrides.pop("vocab_size", tokenizer.get_vocab_size(with_added_tokens=True))
    if vocab < tokenizer.get_vocab_size(with_added_tokens=True):
        raise ValueError(f"vocab_size {vocab} is smaller than the tokenizer's {tokenizer.get_vocab_size()}")
    config = tiny_config(vocab, **overrides)
    save_file(tiny_weights(config, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config.to_hf("float32"), indent=2))
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": BOS,
                "eos_token": EOS,
                "chat_template": CHAT_TEMPLATE,
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        )
    )
    return out


def write_tiny_gguf(
    path: str | Path, seed: int = 0, quantized: tuple[str, ...] | dict[str, str] = (), **overrides: Any
) -> Path:
    """The same tiny model as a llama.cpp-style GGUF file (Q/K rows permuted as llama.cpp does).

    Tensors are F32 (exactly the HF folder's weights) except the GGUF tensor names listed in
    `quantized`, which are stored as Q8_0 (or, for a dict, as the GGML type named for each,
    quantized by the `gguf` package's reference quantizer). The tokenizer goes into the metadata the way
    llama.cpp writes it (tokens, merges, token types, `pre` = "smollm").
    """
    import gguf
    import numpy as np

    from pdserve_worker.model.loading.weights import gguf_to_hf_name, permute_qk

    tokenizer = build_tiny_tokenizer()
    vocab = overrides.pop("vocab_size", tokenizer.get_vocab_size(with_added_tokens=True))
    config = tiny_config(vocab, **overrides)
    if config.rope_scaling is not None:
        raise ValueError("write_tiny_gguf writes no rope scaling metadata")
    weights = tiny_weights(config, seed)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)

    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name("tiny")
    w.add_block_count(config.num_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_heads)
    w.add_head_count_kv(config.num_kv_heads)
    w.add_key_length(config.head_dim)
    w.add_rope_dimension_count(config.head_dim)
    w.add_rope_freq_base(config.rope_theta)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_vocab_size(config.vocab_size)

    state = json.loads(tokenizer.to_str())
    by_id = {i: t for t, i in tokenizer.get_vocab(with_added_tokens=True).items()}
    tokens = [by_id[i] for i in range(len(by_id))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]])
    w.add_bos_token_id(tokenizer.token_to_id(BOS))
    w.add_eos_token_id(tokenizer.token_to_id(EOS))
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    hf_to_gguf = {}
    names = ["token_embd.weight", "output_norm.weight"] + ([] if config.tie_word_embeddings else ["output.weight"])
    for layer in range(config.num_layers):
        for part in (
            "attn_norm",
            "ffn_norm",
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_output",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
        ):
            names.append(f"blk.{layer}.{part}.weight")
    for name in names:
        hf_to_gguf[gguf_to_hf_name(name)] = name
    for hf_name, name in hf_to_gguf.items():
        tensor = weights[hf_name]
        if name.endswith("attn_q.weight"):
            tensor = permute_qk(tensor, config.num_heads)
        elif name.endswith("attn_k.weight"):
            tensor = permute_qk(tensor, config.num_kv_heads)
        array = tensor.numpy().astype(np.float32)
        if name in quantized:
            qtype = gguf.GGMLQuantizationType[quantized[name] if isinstance(quantized, dict) else "Q8_0"]
            w.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


# The structure of Qwen2.5-Instruct's chat template where it handles tools (the tools in the
# system turn inside <tools></tools>, calls in <tool_call> blocks, results as <tool_response>
# in a user turn), for the tool-call tests: the tiny model's own template knows no tools.
QWEN_TOOLS_TEMPLATE = """\
{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}\
{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}\
{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n\
You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}\
{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\
\\n</tool_call><|im_end|>\\n" }}\
{%- elif messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\
{%- endif %}\
{%- for message in messages %}\
{%- if (message.role == "user") or (message.role == "system" and not loop.first) or \
(message.role == "assistant" and not message.tool_calls) %}\
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\
{%- elif message.role == "assistant" %}{{- '<|im_start|>' + message.role }}\
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}\
{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}\
{%- endif %}{{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}\
{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}\
{%- elif message.role == "tool" %}\
{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}\
{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}\
{%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{%- endif %}\
{%- endif %}{%- endfor %}\
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""


def write_tool_model(directory: str | Path) -> Path:
    """The tiny model with QWEN_TOOLS_TEMPLATE as its chat template, and room for its long
    system turn (the tiny tokenizer spends about a token per character)."""
    out = write_tiny_model(directory, max_position_embeddings=2048)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = QWEN_TOOLS_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return out
