"""Qwen3 dense (transformers models/qwen3: Qwen3Config, Qwen3Attention). As Qwen2 but biases by
attention_bias and an RMSNorm over each head of q and k before RoPE; head_dim defaults to 128."""

from pdserve_worker.model.families.base import Family

FAMILY = Family(
    model_type="qwen3",
    hf_class="Qwen3ForCausalLM",
    hf_defaults={
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "head_dim": 128,
        "sliding_window": 4096,
        "max_window_layers": 28,
        "num_key_value_heads": 32,
    },
    biases="attention_bias",
    sliding="per_layer",
    qk_norm=True,
    gguf_architecture="qwen3",
)
