"""Rotary position embedding: inverse frequencies (with scaling) and the rotation itself.

The formulas follow the published definitions that HF transformers also implements
(`rope_type` default, linear, llama3), so that a checkpoint behaves the same here as there;
the rotation uses the "rotate half" convention of HF checkpoints (GGUF's interleaved
convention is converted away when loading its Q/K weights).
"""

from __future__ import annotations

import math

import torch

from pdserve_worker.model.config import ModelConfig


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


def cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin of shape `[*positions.shape, head_dim]`, computed in fp32 then cast.

    The sin's first half is negated so that rotating needs only a roll (see `apply_rotary`).
    """
    freqs = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)
    return emb.cos().to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x [..., head_dim]` by the angles in cos/sin (broadcast over heads); contiguous result.

    Equals HF's `x * cos + rotate_half(x) * sin` exactly: rotate_half(x) = [-x2, x1] is
    roll(x) = [x2, x1] times the sign folded into `signed_sin` (negation and roll are exact).
    """
    rotated = torch.roll(x, shifts=x.shape[-1] // 2, dims=-1)
    return (x * cos + rotated * signed_sin).contiguous()
