"""LLaMA (transformers models/llama: LlamaConfig, LlamaAttention, LlamaModel), also Llama 3 and
the DeepSeek-R1 Llama distills. Biases on every attention projection or none (attention_bias);
no sliding window; llama.cpp stores its Q/K rows permuted."""

from pdserve_worker.model.families.base import Family

FAMILY = Family(
    model_type="llama",
    hf_class="LlamaForCausalLM",
    hf_defaults={
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "head_dim": None,
        "sliding_window": None,
        "num_key_value_heads": None,
    },
    biases="attention_bias",
    sliding="none",
    has_mlp_bias_key=True,
    gguf_architecture="llama",
    gguf_permutes_qk=True,
)
