"""A LLaMA-family decoder's geometry, and what it costs per token in bytes and FLOPs.

Read from an HF `config.json` (the same keys `pdserve_worker.model.config.ModelConfig.from_hf`
reads), or a built-in. Its own small parser rather than the worker's: the worker's module
imports the KV layout package and lives in the image with torch, while the planner must run
in the operator, which has neither. A test checks that both parsers agree on the same file.

Counting conventions (those of the engine, `pdserve_worker.model.layers.llama`):
- a decode step reads every layer's matrices and norms, the final norm and the LM head once
  (the embedding gather is a few rows: not counted); with tied embeddings the LM head is the
  embedding matrix, read once;
- prefill computes the LM head for the last position only;
- attention is causal: the query at position p attends to p + 1 keys.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}


def tensor_parallel_sizes(heads: int, kv_heads: int) -> list[int]:
    """Tensor-parallel sizes `heads` query heads over `kv_heads` KV heads split into evenly: query
    heads divisible, KV heads divisible or replicated. The operator's one copy of the worker's
    model/layers/tensor_parallel.py `valid_sizes` (a test checks they agree)."""
    return [t for t in range(1, heads + 1) if heads % t == 0 and (kv_heads % t == 0 or t % kv_heads == 0)]


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for field in (
            "num_layers",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
        ):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelShape.{field} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelShape.num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    def tensor_parallel_sizes(self) -> list[int]:
        return tensor_parallel_sizes(self.num_heads, self.num_kv_heads)

    # ---- parameters ---------------------------------------------------------------------------

    @property
    def layer_matmul_params(self) -> int:
        """Weights of one layer's matrices: q, k, v, o projections and the gated MLP."""
        q = self.hidden_size * self.num_heads * self.head_dim
        kv = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        o = self.num_heads * self.head_dim * self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        return q + kv + o + mlp

    @property
    def head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def step_read_params(self) -> int:
        """Parameters a decode step reads: layers (matrices + 2 norms), final norm, LM head."""
        return self.num_layers * (self.layer_matmul_params + 2 * self.hidden_size) + self.hidden_size + self.head_params

    @property
    def total_params(self) -> int:
        embed = 0 if self.tie_word_embeddings else self.head_params
        return self.step_read_params + embed

    def weight_bytes(self, dtype_bytes: int) -> int:
        return self.step_read_params * dtype_bytes

    # ---- per token ----------------------------------------------------------------------------

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of every layer for one position (the decode pool's unit; DESIGN.md layout)."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * dtype_bytes

    @property
    def matmul_flops_per_token(self) -> int:
        """Dense FLOPs of one token through every layer (2 per multiply-add), without the head."""
        return 2 * self.num_layers * self.layer_matmul_params

    @property
    def head_flops(self) -> int:
        return 2 * self.head_params

    def attention_flops(self, keys: float) -> float:
        """FLOPs of one query attending to `keys` positions in every layer (QKᵀ and AV)."""
        return 4.0 * self.num_layers * self.num_heads * self.head_dim * keys

    def prefill_attention_flops(self, tokens: int) -> float:
        """Causal attention of a whole prompt: Σ_{p<n} attention_flops(p + 1)."""
        return self.attention_flops(tokens * (tokens + 1) / 2.0)

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_hf_config(cls, data: dict[str, Any], name: str | None = None) -> ModelShape:
        """From an HF `config.json` dict of a LLaMA-family model (llama, mistral, qwen2 keys)."""
        try:
            heads = int(data["num_attention_heads"])
            hidden = int(data["hidden_size"])
            return cls(
                name=name or str(data.get("_name_or_path") or data.get("model_type") or "model"),
                num_layers=int(data["num_hidden_layers"]),
                hidden_size=hidden,
                num_heads=heads,
                num_kv_heads=int(data.get("num_key_value_heads") or heads),
                head_dim=int(data.get("head_dim") or hidden // heads),
                intermediate_size=int(data["intermediate_size"]),
                vocab_size=int(data["vocab_size"]),
                tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
            )
        except KeyError as exc:
            raise ValueError(f"config.json lacks {exc.args[0]!r}, which the planner needs") from exc

    @classmethod
    def load(cls, ref: str | Path) -> ModelShape:
        """A built-in name (`BUILTIN`), an HF folder holding config.json, or a config.json path."""
        if str(ref) in BUILTIN:
            return BUILTIN[str(ref)]
        path = Path(ref)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(
                f"model {str(ref)!r} is neither a built-in ({', '.join(sorted(BUILTIN))}) nor a config.json"
            )
        return cls.from_hf_config(json.loads(path.read_text()), name=path.parent.name or path.stem)


# SmolLM2-135M-Instruct, the bundled default model (FACTS.md; its GGUF metadata).
SMOLLM2_135M = ModelShape(
    name="SmolLM2-135M-Instruct",
    num_layers=30,
    hidden_size=576,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    intermediate_size=1536,
    vocab_size=49152,
    tie_word_embeddings=True,
)
# LLaMA-7B, the seeds' model: meta-llama/Llama-2-7b-hf config.json (LLaMA-1 7B has the same shape).
LLAMA_7B = ModelShape(
    name="Llama-2-7b",
    num_layers=32,
    hidden_size=4096,
    num_heads=32,
    num_kv_heads=32,
    head_dim=128,
    intermediate_size=11008,
    vocab_size=32000,
    tie_word_embeddings=False,
)
BUILTIN: dict[str, ModelShape] = {"smollm2-135m": SMOLLM2_135M, "llama-7b": LLAMA_7B}
