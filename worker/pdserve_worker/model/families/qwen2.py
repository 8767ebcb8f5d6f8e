"""Qwen2 / Qwen2.5 (transformers models/qwen2: Qwen2Config, Qwen2Attention), also the
DeepSeek-R1 Qwen distills. q/k/v always carry biases, o never; a sliding window only with
use_sliding_window, on the layers from max_window_layers (or as layer_types says)."""

from pdserve_worker.model.families.base import Family

FAMILY = Family(
    model_type="qwen2",
    hf_class="Qwen2ForCausalLM",
    hf_defaults={
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "head_dim": None,
        "sliding_window": 4096,
        "max_window_layers": 28,
        "num_key_value_heads": 32,
    },
    biases="qkv",
    sliding="per_layer",
    gguf_architecture="qwen2",
)
