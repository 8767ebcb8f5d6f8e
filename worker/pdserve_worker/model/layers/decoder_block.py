"""One decoder layer's arithmetic around attention: the attention norm, the QKV projection and
RoPE before it; the output projection, residual and MLP after it (and, on a tensor-parallel
rank, the reduce of o_proj's and down_proj's partial products). The elementwise steps run as
the native ops (model/layers/native.py) where they are built, else as plain torch."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pdserve_worker.model.config import ModelConfig
from pdserve_worker.model.layers import native, paged_attention, slot_attention
from pdserve_worker.model.layers.layer_weights import LayerWeights
from pdserve_worker.model.layers.matmul import Linear
from pdserve_worker.model.layers.paged_attention import PagedPlan
from pdserve_worker.model.layers.rope import apply_rotary
from pdserve_worker.model.layers.slot_attention import SlotPlan


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as HF LLaMA computes it: normalize in fp32, round to the model dtype, then weight.

    Keeping HF's two roundings in bf16 matters: near-tied logits (SmolLM2's first answer token
    to "What is the capital of France?" leads by 0.08) flip with a one-rounding fused norm.
    """
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


class DecoderBlock:
    """The layer forward shared by every layer of a `LlamaModel` (the weights are per call)."""

    def __init__(
        self,
        config: ModelConfig,
        linear: Linear,
        device: torch.device,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.config, self.linear, self.device, self.reduce = config, linear, device, reduce

    def __call__(
        self, x: torch.Tensor, w: LayerWeights, keys: torch.Tensor, values: torch.Tensor, plan: SlotPlan | PagedPlan
    ) -> torch.Tensor:
        """Layer `w` over hidden `x [B, T, hidden]`: its K/V written to and attention read from
        one layer's `keys`/`values` of the pool as `plan` lays them out."""
        q, k, v = self._qkv(x, w, plan)
        if isinstance(plan, PagedPlan):
            return self._finish_layer(x, paged_attention.write_and_attend(q, k, v, keys, values, plan), w)
        return self._finish_layer(x, slot_attention.write_and_attend(q, k, v, keys, values, plan), w)

    def fused(self) -> bool:
        """Whether a layer's elementwise steps run as the native ops (model/layers/native.py)."""
        return self.device.type == "cpu" and native.available()

    def _qkv(
        self, x: torch.Tensor, w: LayerWeights, plan: SlotPlan | PagedPlan
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Attention norm, the QKV projection and RoPE: q `[B, T, heads, D]`, k and v `[B, T,
        kv_heads, D]`."""
        cfg = self.config
        batch, tokens, _ = x.shape
        heads, kv_heads, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if self.fused():  # the same steps as below, fused
            h = native.rms_norm(x, w.attn_norm, cfg.rms_norm_eps)
            qkv = self.linear(h, w.qkv, bias=w.qkv_bias)
            return native.rope_qkv(qkv, plan.cos, plan.sin, heads, kv_heads, w.qk_norm, cfg.rms_norm_eps)
        h = rms_norm(x, w.attn_norm, cfg.rms_norm_eps)
        qkv = self.linear(h, w.qkv, bias=w.qkv_bias)
        qk = qkv[..., : (heads + kv_heads) * head_dim].view(batch, tokens, heads + kv_heads, head_dim)
        if w.qk_norm is not None:  # qwen3: RMSNorm over each head's head_dim, before RoPE
            qk = rms_norm(qk, w.qk_norm, cfg.rms_norm_eps)
        # Q and K rotate together (one set of ops); SDPA's fast kernels need the contiguous result.
        qk = apply_rotary(qk, plan.cos, plan.sin)
        v = qkv[..., (heads + kv_heads) * head_dim :].view(batch, tokens, kv_heads, head_dim)
        return qk[:, :, :heads], qk[:, :, heads:], v

    def _finish_layer(self, x: torch.Tensor, attn: torch.Tensor, w: LayerWeights) -> torch.Tensor:
        """Output projection, residual, MLP: everything of a layer after attention."""
        eps, reduce = self.config.rms_norm_eps, self.reduce or _same
        if self.fused():  # the same steps as below, fused
            x, h = native.add_rms_norm(x, reduce(self.linear(attn, w.o, bias=w.o_bias)), w.mlp_norm, eps)
            return x + reduce(self.linear(native.silu_mul(self.linear(h, w.gate_up)), w.down))
        x = x + reduce(self.linear(attn, w.o, bias=w.o_bias))
        h = rms_norm(x, w.mlp_norm, eps)
        gate, up = self.linear(h, w.gate_up).chunk(2, dim=-1)
        return x + reduce(self.linear(F.silu(gate) * up, w.down))
