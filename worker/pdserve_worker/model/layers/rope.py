"""Rotary position embedding: inverse frequencies (with scaling) and the rotation itself.

The formulas follow the published definitions that HF transformers also implements
(`modeling_rope_utils`: rope_type default, linear, llama3, yarn, dynamic), so that a checkpoint
behaves the same here as there; the rotation uses the "rotate half" convention of HF
checkpoints (GGUF's interleaved LLaMA convention is converted away when loading its Q/K
weights; qwen2/qwen3 GGUF files already use halves, llama.cpp's NEOX rope).

YaRN is static, as in transformers and vLLM: the frequencies are the scaled ones at every
length, and cos/sin carry its attention factor. Dynamic NTK equals the plain rope up to
max_position_embeddings and recomputes the frequencies per forward length beyond it, which a
KV cache written by another process cannot follow; `ModelConfig.check_max_len` refuses that.
"""

from __future__ import annotations

import math

import torch

from pdserve_worker.model.config import ModelConfig


def attention_scaling(config: ModelConfig) -> float:
    """The factor cos and sin are multiplied by: YaRN's attention temperature, else 1."""
    if config.rope_type != "yarn":
        return 1.0
    scaling = config.rope_scaling or {}
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all_dim))
    return _yarn_mscale(factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inverse_frequencies(config: ModelConfig, freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 `[head_dim/2]` inverse frequencies after the config's scaling.

    `freq_factors` is GGUF's `rope_freqs.weight` (llama3-style scaling baked in by llama.cpp):
    each frequency is divided by its factor.
    """
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    rope_type = config.rope_type
    if rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3(inv_freq, scaling, config.max_position_embeddings)
    elif rope_type == "yarn":
        inv_freq = _yarn(config.rope_theta, dim, scaling)
    # "dynamic": the plain frequencies, which it keeps up to max_position_embeddings.
    if freq_factors is not None:
        if freq_factors.numel() != inv_freq.numel():
            raise ValueError(f"rope_freqs has {freq_factors.numel()} factors, head_dim/2 is {inv_freq.numel()}")
        inv_freq = inv_freq / freq_factors.float().reshape(-1)
    return inv_freq


def _llama3(inv_freq: torch.Tensor, scaling: dict, max_positions: int) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths slowed by `factor`, short kept, the middle blended."""
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", max_positions))
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def _yarn(base: float, dim: int, scaling: dict) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): frequencies that turn fewer than `beta_slow` times over the original
    context are interpolated (divided by `factor`), those turning more than `beta_fast` times are
    kept, with a linear ramp between, over dimension indices (transformers' `_compute_yarn_parameters`)."""
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:  # the dimension index whose frequency turns `rotations` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (unchanged frequency), 0: interpolate
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin of shape `[*positions.shape, head_dim]`, computed in fp32 then cast.

    The sin's first half is negated so that rotating needs only a roll (see `apply_rotary`).
    `scale` (YaRN's attention factor) multiplies both in fp32, as transformers does.
    """
    freqs = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)
    cos = emb.cos()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x [..., head_dim]` by the angles in cos/sin (broadcast over heads); contiguous result.

    Equals HF's `x * cos + rotate_half(x) * sin` exactly: rotate_half(x) = [-x2, x1] is
    roll(x) = [x2, x1] times the sign folded into `signed_sin` (negation and roll are exact).
    """
    rotated = torch.roll(x, shifts=x.shape[-1] // 2, dims=-1)
    return (x * cos + rotated * signed_sin).contiguous()
