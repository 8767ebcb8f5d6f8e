"""The geometry of a LLaMA-family decoder, read from an HF `config.json` or GGUF metadata.

One dataclass is the single description every role shares: the model builds itself from it,
a KV pool is sized from it (`kv_layout`), and the GGUF conversion writes it back out as an HF
`config.json` so a converted folder loads like any other HF folder.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from pdserve_worker.kv.layout import KVLayout

# HF model types whose checkpoints are the plain LLaMA block this engine implements.
SUPPORTED_MODEL_TYPES = ("llama", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    # None, or {"rope_type": "linear"|"llama3", "factor": ..., ...} in HF's key names.
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(
                    f"ModelConfig.rope_scaling type {rope_type!r} is not supported; expected one of {SUPPORTED_ROPE_TYPES}"
                )

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return str(self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default")))

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def kv_layout(
        self,
        num_slots: int,
        max_len: int,
        dtype: str = "bfloat16",
        first_layer: int = 0,
        num_layers: int | None = None,
    ) -> KVLayout:
        """The KV pool geometry for this model: all layers, or `num_layers` from `first_layer`."""
        count = self.num_layers - first_layer if num_layers is None else num_layers
        if first_layer < 0 or count <= 0 or first_layer + count > self.num_layers:
            raise ValueError(
                f"layers {first_layer}..{first_layer + count - 1} outside the model's 0..{self.num_layers - 1}"
            )
        if max_len > self.max_position_embeddings:
            raise ValueError(f"max_len {max_len} exceeds the model's max_position_embeddings {self.max_position_embeddings}")
        return KVLayout(
            num_slots=num_slots,
            num_layers=count,
            max_len=max_len,
            kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=dtype,
            first_layer=first_layer,
        )

    # ---- HF config.json -------------------------------------------------------------------

    @classmethod
    def from_hf(cls, data: dict[str, Any]) -> "ModelConfig":
        """From an HF `config.json` dict (transformers 4.x `rope_scaling` or 5.x `rope_parameters`)."""
        model_type = data.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"config.json model_type {model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}")
        for flag in ("attention_bias", "mlp_bias"):
            if data.get(flag):
                raise ValueError(f"config.json {flag}=true is not supported by this engine")
        heads = int(data["num_attention_heads"])
        rope = dict(data.get("rope_parameters") or data.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", data.get("rope_theta", 10000.0)))
        rope.pop("partial_rotary_factor", None)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        eos = data.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            vocab_size=int(data["vocab_size"]),
            hidden_size=int(data["hidden_size"]),
            intermediate_size=int(data["intermediate_size"]),
            num_layers=int(data["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(data.get("num_key_value_heads") or heads),
            head_dim=int(data.get("head_dim") or data["hidden_size"] // heads),
            rope_theta=theta,
            rope_scaling=None if rope_type == "default" else rope,
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(data.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
            bos_token_id=data.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def to_hf(self, torch_dtype: str = "float32") -> dict[str, Any]:
        """An HF `config.json` dict that transformers' LlamaForCausalLM also loads."""
        data: dict[str, Any] = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_id,
            "torch_dtype": torch_dtype,
        }
        return data

    # ---- GGUF metadata ----------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], tensor_names: set[str]) -> "ModelConfig":
        """From GGUF key/values (already decoded to Python values) and the file's tensor names."""
        arch = meta.get("general.architecture")
        if arch != "llama":
            raise ValueError(f"GGUF general.architecture {arch!r} is not supported; expected 'llama'")

        def get(key: str, default: Any = None) -> Any:
            value = meta.get(f"{arch}.{key}", default)
            if value is None:
                raise ValueError(f"GGUF metadata lacks {arch}.{key}")
            return value

        heads = int(get("attention.head_count"))
        hidden = int(get("embedding_length"))
        vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or [])
        scaling_type = meta.get(f"{arch}.rope.scaling.type")
        rope_scaling = None
        if scaling_type == "linear":
            rope_scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
        elif scaling_type not in (None, "none"):
            raise ValueError(f"GGUF {arch}.rope.scaling.type {scaling_type!r} is not supported")
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return cls(
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=heads,
            num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv") or heads),
            head_dim=int(meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count") or hidden // heads),
            rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            max_position_embeddings=int(get("context_length")),
            # llama.cpp writes no output.weight when the LM head is the embedding matrix.
            tie_word_embeddings="output.weight" not in tensor_names,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (int(eos),),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
