"""The geometry of a decoder this engine runs, read from an HF `config.json` (or GGUF metadata).

One dataclass is the description every role shares: the model builds itself from it, a KV pool
is sized from it (`kv_layout`), `pdserve info` does its arithmetic with it, and the GGUF
conversion writes it back out as an HF `config.json`.

The families are the LLaMA block and its relatives, which differ only in a few switches: each is
one module of `model/families/`, and this module asks the family, never names one. What the
engine cannot reproduce exactly is refused with the field's name, never approximated: another
activation, MLP bias, partial rotary, rope types other than default/linear/llama3/yarn/dynamic,
quantized checkpoints, and sliding-window attention beyond the window (see `kv_layout`).
This module imports no torch: `pdserve info` runs without it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from pdserve_common.kv_layout import DTYPE_SIZES, KVLayout
from pdserve_worker.model.families import FAMILIES, NAMES, family

# Tokens per request (prompt plus output) when none is asked for: the CRD's spec.model.maxLength
# default; `serving_max_len` lowers it to a shorter model's context.
DEFAULT_MAX_LEN = 2048
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")

DEFAULT_ROPE_THETA = 10000.0  # transformers' PreTrainedConfig.default_theta


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
    # None, or {"rope_type": "linear"|"llama3"|"yarn"|"dynamic", "factor": ..., ...} in HF's key names.
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-6
    # The longest context this engine serves for the model: config.json's value, or for YaRN the
    # original length times the factor (as vLLM derives it); the rope itself reads
    # rope_scaling["original_max_position_embeddings"].
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    architecture: str = "llama"  # HF model_type: one of model/families NAMES
    qkv_bias: bool = False  # q_proj/k_proj/v_proj carry a bias
    o_bias: bool = False  # o_proj carries a bias
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (qwen3)
    # The window of the layers that use sliding-window attention (None: every layer is full).
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if self.architecture not in FAMILIES:
            raise ValueError(f"ModelConfig.architecture {self.architecture!r} is not one of {NAMES}")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window <= 0):
            raise ValueError(f"ModelConfig.sliding_window must be a positive int or None, got {self.sliding_window!r}")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(
                    f"rope_scaling.rope_type {rope_type!r} is not supported; expected one of {SUPPORTED_ROPE_TYPES}"
                )
            if rope_type != "default" and not isinstance(self.rope_scaling.get("factor"), (int, float)):
                raise ValueError(
                    f"rope_scaling.factor must be a number for rope_type {rope_type!r}, "
                    f"got {self.rope_scaling.get('factor')!r}"
                )

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return str(self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default")))

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def kv_bytes_per_token(self, dtype: str = "bfloat16") -> int:
        """KV bytes one token takes over all layers: layers x (K, V) x kv_heads x head_dim x dtype."""
        if dtype not in DTYPE_SIZES:
            raise ValueError(f"KV dtype must be one of {sorted(DTYPE_SIZES)}, got {dtype!r}")
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * DTYPE_SIZES[dtype]

    def serving_max_len(self, requested: int | None = None) -> int:
        """The per-request token budget to serve: `requested` (refused if the engine cannot serve it,
        see check_max_len), or when None DEFAULT_MAX_LEN capped at the longest it serves exactly
        (the context, or the sliding window), as vLLM defaults max_model_len to the model's."""
        if requested is None:
            limit = min(self.max_position_embeddings, self.sliding_window or self.max_position_embeddings)
            return min(DEFAULT_MAX_LEN, limit)
        self.check_max_len(requested)
        return requested

    def check_max_len(self, max_len: int) -> None:
        """Refuse a per-request token budget the engine would not compute as transformers does."""
        if max_len > self.max_position_embeddings:
            why = ""
            if self.rope_type == "dynamic":
                why = (
                    " (rope_scaling.rope_type 'dynamic' recomputes the rotary frequencies beyond it, per forward "
                    "length: cached keys would no longer match; not supported)"
                )
            raise ValueError(
                f"max_len {max_len} exceeds the model's max_position_embeddings {self.max_position_embeddings}{why}"
            )
        if self.sliding_window is not None and max_len > self.sliding_window:
            raise ValueError(
                f"max_len {max_len} exceeds the model's sliding_window {self.sliding_window} (config.json "
                f"{FAMILIES[self.architecture].sliding_key()}): this engine "
                f"attends over the whole context, which equals sliding-window attention only up to "
                f"{self.sliding_window} tokens; serve with max_len <= {self.sliding_window}"
            )

    def kv_layout(
        self,
        num_slots: int,
        max_len: int,
        dtype: str = "bfloat16",
        first_layer: int = 0,
        num_layers: int | None = None,
        first_head: int = 0,
    ) -> KVLayout:
        """The KV pool geometry for this model: all layers, or `num_layers` from `first_layer`
        (`first_head`: where a tensor-parallel rank's KV heads start among the whole model's)."""
        count = self.num_layers - first_layer if num_layers is None else num_layers
        if first_layer < 0 or count <= 0 or first_layer + count > self.num_layers:
            raise ValueError(
                f"layers {first_layer}..{first_layer + count - 1} outside the model's 0..{self.num_layers - 1}"
            )
        self.check_max_len(max_len)
        return KVLayout(
            num_slots=num_slots,
            num_layers=count,
            max_len=max_len,
            kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=dtype,
            first_layer=first_layer,
            first_head=first_head,
        )

    # ---- HF config.json -------------------------------------------------------------------

    @classmethod
    def from_hf(cls, data: dict[str, Any]) -> ModelConfig:
        """From an HF `config.json` dict (transformers 4.x `rope_scaling` or 5.x `rope_parameters`)."""
        model_type = data.get("model_type", "llama")
        fam = family(model_type)
        quant = data.get("quantization_config")
        if quant:
            method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
            raise ValueError(
                f"config.json quantization_config (quant_method {method!r}) is not supported: "
                "serve the unquantized (bf16/fp16) checkpoint or a GGUF file"
            )
        act = data.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config.json hidden_act {act!r} is not supported; expected 'silu'")
        fam.refuse(data)
        defaults = fam.hf_defaults
        hidden = _int(data, "hidden_size")
        heads = _int(data, "num_attention_heads")
        layers = _int(data, "num_hidden_layers")
        head_dim = data.get("head_dim")
        if head_dim is None:
            head_dim = defaults["head_dim"] or hidden // heads
        max_pos = int(data.get("max_position_embeddings") or defaults["max_position_embeddings"])
        theta, rope = _rope(data, max_pos)
        if rope and rope["rope_type"] == "yarn":
            max_pos = max(max_pos, int(rope["original_max_position_embeddings"] * rope["factor"]))

        qkv_bias, o_bias = fam.projection_biases(data)
        eos = data.get("eos_token_id")
        eos_ids = tuple(int(e) for e in eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            vocab_size=_int(data, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_int(data, "intermediate_size"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(data.get("num_key_value_heads", defaults["num_key_value_heads"]) or heads),
            head_dim=int(head_dim),
            rope_theta=theta,
            rope_scaling=rope,
            rms_norm_eps=float(data.get("rms_norm_eps") or defaults["rms_norm_eps"]),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
            bos_token_id=data.get("bos_token_id"),
            eos_token_ids=eos_ids,
            architecture=model_type,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            qk_norm=fam.qk_norm,
            sliding_window=fam.sliding_window(data, layers),
        )

    def to_hf(self, torch_dtype: str = "float32") -> dict[str, Any]:
        """An HF `config.json` dict that transformers' class of the family (`Family.hf_class`) loads as this model."""
        arch = self.architecture
        fam = FAMILIES[arch]
        if not fam.expresses(self.qkv_bias, self.o_bias, self.qk_norm):
            raise ValueError(
                f"{arch} has no config.json for qkv_bias={self.qkv_bias} o_bias={self.o_bias} qk_norm={self.qk_norm}"
            )
        rope = dict(self.rope_scaling) if self.rope_scaling else None
        data: dict[str, Any] = {
            "architectures": [fam.hf_class],
            "model_type": arch,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "rope_scaling": rope,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_id,
            "torch_dtype": torch_dtype,
        }
        data.update(fam.hf_keys(self.qkv_bias, self.sliding_window, self.num_layers))
        return data

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _int(data: dict[str, Any], key: str) -> int:
    value = data.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"config.json {key} must be a positive integer, got {value!r}")
    return value


def _rope(data: dict[str, Any], max_pos: int) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, canonical rope_scaling or None) as transformers standardizes them.

    transformers 5 reads `rope_scaling` first, then `rope_parameters`; `type` is the old name of
    `rope_type`; llama3 and yarn default `original_max_position_embeddings` to
    max_position_embeddings (`RotaryEmbeddingConfigMixin.standardize_rope_params`).
    """
    raw = data.get("rope_scaling") or data.get("rope_parameters") or {}
    if not isinstance(raw, dict):
        raise ValueError(f"config.json rope_scaling must be an object, got {raw!r}")
    rope = dict(raw)
    theta = float(rope.pop("rope_theta", None) or data.get("rope_theta") or DEFAULT_ROPE_THETA)
    partial = rope.pop("partial_rotary_factor", data.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"config.json partial_rotary_factor {partial!r} is not supported (only full rotary)")
    rope_type = rope.pop("rope_type", None) or rope.get("type") or "default"
    rope.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"config.json rope_scaling.rope_type {rope_type!r} is not supported; expected one of {SUPPORTED_ROPE_TYPES}"
        )
    if rope_type == "default":
        return theta, None
    if rope_type in ("llama3", "yarn"):
        rope.setdefault("original_max_position_embeddings", max_pos)
    if rope_type == "yarn" and rope.get("factor") is None:
        # transformers: the factor is then the ratio of the post- and pre-YaRN context lengths.
        rope["factor"] = max_pos / rope["original_max_position_embeddings"]
    if not isinstance(rope.get("factor"), (int, float)) or rope["factor"] <= 0:
        raise ValueError(f"config.json rope_scaling.factor must be a positive number, got {rope.get('factor')!r}")
    return theta, {"rope_type": rope_type, **rope}
