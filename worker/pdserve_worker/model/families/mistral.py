"""Mistral (transformers models/mistral: MistralConfig, MistralAttention, MistralModel). No
attention biases; one sliding window over every layer when config.json sets sliding_window.
Its GGUF files say general.architecture "llama" and load as that family."""

from pdserve_worker.model.families.base import Family

FAMILY = Family(
    model_type="mistral",
    hf_class="MistralForCausalLM",
    hf_defaults={
        "max_position_embeddings": 4096 * 32,
        "rms_norm_eps": 1e-6,
        "head_dim": None,
        "sliding_window": 4096,
        "num_key_value_heads": 8,
    },
    biases="none",
    sliding="every_layer",
)
