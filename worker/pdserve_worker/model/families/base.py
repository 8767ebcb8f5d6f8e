"""What distinguishes one HF model family from another in the one LLaMA-block forward.

Every family the engine serves is the LLaMA decoder (RMSNorm, rotary attention with grouped
KV heads, a SiLU-gated MLP) with a few switches; a `Family` is those switches, read from the
family's transformers modeling and config code, and the rules that turn a `config.json` (or a
GGUF file's tensors) into them. `model/config.py` and `model/loading/gguf_format.py` ask the
family; neither names one. A new family of this kind is one module in this package and one
line in its `NAMES`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

# How the attention projections carry biases:
#   "attention_bias": q/k/v and o together, as config.json's attention_bias says (LlamaAttention)
#   "qkv": q/k/v always, o never (Qwen2Attention)
#   "none": never (MistralAttention)
Biases = Literal["attention_bias", "qkv", "none"]
# Which layers slide, and what config.json says so with:
#   "none": no layer (LlamaModel has no sliding window)
#   "every_layer": every layer when sliding_window is set (MistralModel: one mask for all)
#   "per_layer": use_sliding_window, then layer_types or the layers from max_window_layers (Qwen2/Qwen3)
Sliding = Literal["none", "every_layer", "per_layer"]


@dataclass(frozen=True)
class Family:
    model_type: str  # config.json's model_type
    hf_class: str  # the transformers class that loads it (written into a converted folder)
    # What transformers' config class (5.x) uses for keys a config.json may omit
    # (num_key_value_heads None: as many as the query heads; head_dim None: hidden / heads).
    hf_defaults: Mapping[str, Any]
    biases: Biases
    sliding: Sliding
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3Attention)
    has_mlp_bias_key: bool = False  # config.json names mlp_bias (LlamaConfig); true is refused
    # llama.cpp's general.architecture for this family, or None when no GGUF of it is read.
    gguf_architecture: str | None = None
    # Whether llama.cpp stored Q/K rows permuted (GGML's "normal" rope; LlamaModel.modify_tensors).
    gguf_permutes_qk: bool = False

    def projection_biases(self, data: Mapping[str, Any]) -> tuple[bool, bool]:
        """(q/k/v carry a bias, o carries a bias) for a config.json of this family."""
        if self.biases == "attention_bias":
            bias = bool(data.get("attention_bias", False))
            return bias, bias
        return (True, False) if self.biases == "qkv" else (False, False)

    def expresses(self, qkv_bias: bool, o_bias: bool, qk_norm: bool) -> bool:
        """Whether some config.json of this family describes these switches."""
        if qk_norm != self.qk_norm:
            return False
        if self.biases == "attention_bias":
            return qkv_bias == o_bias
        return (qkv_bias, o_bias) == ((True, False) if self.biases == "qkv" else (False, False))

    def refuse(self, data: Mapping[str, Any]) -> None:
        """Refuse, by the key's name, what this family's config allows and the engine does not run."""
        if self.has_mlp_bias_key and data.get("mlp_bias"):
            raise ValueError("config.json mlp_bias=true is not supported by this engine")

    def sliding_window(self, data: Mapping[str, Any], layers: int) -> int | None:
        """The window of the layers that slide, as transformers decides which do; None when none does."""
        window = data.get("sliding_window", self.hf_defaults.get("sliding_window"))
        if self.sliding == "none":
            return None
        if self.sliding == "every_layer":
            return None if window is None else int(window)
        if not data.get("use_sliding_window", False):  # Qwen2Config/Qwen3Config.__post_init__
            window = None
        layer_types = data.get("layer_types")
        if layer_types is None:
            first = int(data.get("max_window_layers", self.hf_defaults["max_window_layers"]))
            layer_types = [
                "sliding_attention" if window is not None and i >= first else "full_attention" for i in range(layers)
            ]
        odd = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
        if odd:
            raise ValueError(f"config.json layer_types {odd} are not supported (full_attention, sliding_attention)")
        if window is None or "sliding_attention" not in layer_types:
            return None  # Qwen2Attention: a sliding layer without a window attends over everything
        return int(window)

    def hf_keys(self, qkv_bias: bool, sliding_window: int | None, num_layers: int) -> dict[str, Any]:
        """The family's own config.json keys for these switches (the shared ones are ModelConfig.to_hf's)."""
        keys: dict[str, Any] = {}
        if self.biases == "attention_bias":
            keys["attention_bias"] = qkv_bias
        if self.has_mlp_bias_key:
            keys["mlp_bias"] = False
        if self.sliding == "every_layer":
            keys["sliding_window"] = sliding_window
        if self.sliding == "per_layer":
            # Every layer sliding when there is a window: within max_len <= window it is full attention anyway.
            keys.update(
                use_sliding_window=sliding_window is not None,
                sliding_window=sliding_window,
                max_window_layers=0 if sliding_window is not None else num_layers,
            )
        return keys

    def sliding_key(self) -> str:
        """How config.json turned the window on (named in the refusal of a longer max_len)."""
        return "sliding_window" if self.sliding == "every_layer" else "use_sliding_window=true"

    def check_gguf_tensors(self, qkv_bias: bool, qk_norm: bool) -> None:
        """Refuse a GGUF file whose tensors contradict the family's attention."""
        arch = self.gguf_architecture
        if self.biases == "qkv" and not qkv_bias:
            raise ValueError(f"GGUF {arch} file lacks blk.0.attn_q.bias ({self.hf_class} has q/k/v biases)")
        if self.qk_norm and not qk_norm:
            raise ValueError(f"GGUF {arch} file lacks blk.0.attn_q_norm.weight ({self.hf_class} normalizes q and k)")
        if qk_norm and not self.qk_norm:
            raise ValueError(f"GGUF {arch} file has attn_q_norm tensors, which {arch} does not use")
