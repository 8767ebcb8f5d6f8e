"""A LLaMA-family decoder in plain torch whose KV lives in an explicit, externally owned pool.

One forward serves every family `ModelConfig` describes (llama, mistral, qwen2, qwen3): they
differ in q/k/v (and o) biases, qwen3's per-head RMSNorm of q and k before RoPE, head_dim,
GQA and the rope scaling; each switch is applied where transformers' modeling code applies it.

The forward is split the way PD serving needs it: `embed` → `run_layers(range)` → `head`.
Prefill runs layer chunks and tells the transfer after each chunk that its KV is final
(`prefill(..., on_chunk=...)`); a layer-sharded decode member runs only its range and passes
the hidden state on; `decode_step` advances a batch of slots of different lengths by one
token (continuous batching: the batch may change between steps).

Numerics mirror HF transformers' LlamaForCausalLM (RMSNorm in fp32, cos/sin computed in
fp32 then cast, rotate-half RoPE), so fp32 logits match it closely and greedy text matches.

Performance notes (CPU, measured): Q/K/V and gate/up are fused into one matmul each (fewer,
larger GEMMs); every matrix goes through `matmul.Linear`, which prepacks it for oneDNN where
the CPU runs the dtype natively (batch-1 decode 1.4x faster), runs fp32 decode steps on a native
kernel on AVX2 CPUs (csrc/dense_linear.cpp) and upcasts multi-row bf16 products
block by block where it does not; SDPA always gets 4-D inputs (3-D inputs fall back to a path 2-8x slower);
single-token decode reshapes the query to `[kv_heads, heads/kv_heads, head_dim]` instead of
asking SDPA for GQA (slow in bf16); and batched decode reads the KV of consecutive slots as
one strided view of the pool with a length mask instead of gathering it (a gather costs more
than the attention itself).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve_worker.kv.cache import KVCache
from pdserve_worker.kv.paged import PagedKVCache
from pdserve_worker.model.config import ModelConfig
from pdserve_worker.model.layers import native, paged_attention
from pdserve_worker.model.layers.matmul import BlockMatrix, Linear
from pdserve_worker.model.layers.native import DecodeRows
from pdserve_worker.model.layers.paged_attention import PagedPlan
from pdserve_worker.model.layers.quant import QuantizedTensor, dequantize, quantize, to_kind
from pdserve_worker.model.layers.rope import apply_rotary, attention_scaling, cos_sin, inverse_frequencies
from pdserve_worker.model.layers.weight_routes import groups as matrix_groups
from pdserve_worker.model.shapes import weight_shapes

# Logits a quantized head recomputes in fp32 from the exact rows (see `LlamaModel.head`).
REFINED_LOGITS = 16


@dataclass(frozen=True)
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden]
    # The four matrices are as `Linear.prepare`/`prepare_quantized` returned them (possibly opaque
    # oneDNN tensors or `matmul.Int4Matrix`): pass them to `LlamaModel.linear`, nowhere else.
    qkv: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]
    o: torch.Tensor  # [hidden, heads * head_dim]
    mlp_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]
    qkv_bias: torch.Tensor | None = None  # [(heads + 2 * kv_heads) * head_dim]
    o_bias: torch.Tensor | None = None  # [hidden]
    # qwen3's q_norm and k_norm weights, one row per head: [heads + kv_heads, head_dim].
    qk_norm: torch.Tensor | None = None


@dataclass(frozen=True)
class _Run:
    """Rows [row_start, row_stop) of a batch whose slots are consecutive from `slot_start`."""

    row_start: int
    row_stop: int
    slot_start: int
    key_len: int  # keys to read per slot: max(position + T) over the run's rows
    mask: torch.Tensor | None  # [rows, 1, T, key_len] bool (True = attend), None when plainly causal/full


@dataclass(frozen=True)
class _Segment:
    """Tokens [start, stop) of a packed row: one prompt, written at `position`.. of `slot`."""

    start: int
    stop: int
    slot: int
    position: int
    mask: torch.Tensor | None  # [1, 1, n, position + n] bool, None when plainly causal (position 0)


@dataclass(frozen=True)
class _StepPlan:
    """What every layer of one call shares: positions, rotary angles, slot runs.

    A packed plan (`segments` set) holds several prompts in one row `[1, total, hidden]`:
    `slots` and `positions` are then per token `[total]`, and attention runs per segment."""

    slots: torch.Tensor  # [B] long (packed: [total])
    positions: torch.Tensor  # [B, T] long (packed: [total])
    first: tuple[int, int]  # (slot, start position) of row 0, as Python ints (no device sync per layer)
    cos: torch.Tensor  # [B, T, 1, head_dim]
    sin: torch.Tensor
    runs: tuple[_Run, ...]
    tokens: int  # T
    segments: tuple[_Segment, ...] = ()
    kernel: DecodeRows | None = None  # a decode step (T == 1) through the native kernel, when it serves


def _room(cache: KVCache | PagedKVCache, slot: int) -> int:
    """Tokens the KV of `slot` can hold: a slot's max_len, or its bound block table's capacity."""
    return cache.capacity(slot) if isinstance(cache, PagedKVCache) else cache.layout.max_len


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as HF LLaMA computes it: normalize in fp32, round to the model dtype, then weight.

    Keeping HF's two roundings in bf16 matters: near-tied logits (SmolLM2's first answer token
    to "What is the capital of France?" leads by 0.08) flip with a one-rounding fused norm.
    """
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def check_weights(
    config: ModelConfig,
    weights: Mapping[str, torch.Tensor],
    layers: range,
    quantized: Mapping[str, QuantizedTensor] | None = None,
) -> None:
    """Every tensor the config implies for `layers` is present with its shape (names the first that
    is not), as a float tensor or, for a matrix, quantized."""
    quantized = quantized or {}
    for name, shape in weight_shapes(config, layers).items():
        tensor = weights.get(name, quantized.get(name))
        if tensor is None:
            why = " (config.json tie_word_embeddings is false)" if name == "lm_head.weight" else ""
            raise ValueError(f"weight {name!r} missing from checkpoint{why}")
        if tuple(tensor.shape) != shape:
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, config.json implies {shape}")


def _hf(name: str, weights: Mapping[str, torch.Tensor]) -> torch.Tensor:
    try:
        return weights[name]
    except KeyError:
        raise KeyError(f"weight {name!r} missing from checkpoint") from None


class _Weights:
    """Builds `LlamaModel`'s tensors from a checkpoint: each in the model's dtype and device,
    each matrix group as its route runs it fastest (`weight_routes.plan`)."""

    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, torch.Tensor],
        quantized: Mapping[str, QuantizedTensor],
        groups: Mapping[str, Sequence[str]],
        routes: Mapping[str, str],
        linear: Linear,
    ) -> None:
        self.config, self.weights, self.quantized = config, weights, quantized
        self.groups, self.routes, self.linear = groups, routes, linear

    def take(self, name: str) -> torch.Tensor:
        # Same dtype and device: the checkpoint's (memory-mapped) tensor itself, no copy.
        return _hf(name, self.weights).to(device=self.linear.device, dtype=self.linear.dtype).contiguous()

    def fused(self, *names: str) -> torch.Tensor:
        # One pass per part (cast and copy together) into the fused matrix: loading stays fast.
        parts = [_hf(n, self.weights) for n in names]
        rows = sum(p.shape[0] for p in parts)
        out = torch.empty((rows, *parts[0].shape[1:]), dtype=self.linear.dtype, device=self.linear.device)
        row = 0
        for part in parts:
            out[row : row + part.shape[0]].copy_(part)
            row += part.shape[0]
        return out

    def matrix(self, group: str, dense: Callable[[], torch.Tensor]) -> torch.Tensor | object:
        """A group's matrix as its route runs it fastest (a prepacked, opaque oneDNN or
        quantized matrix: for `Linear` only)."""
        route, names, quantized = self.routes[group], self.groups[group], self.quantized
        if route == "dequantized":
            return self.linear.prepare(dense())
        # The checkpoint's own blocks where it has them (int8 holds 4- and 8-bit ones exactly),
        # else the float weights quantized by llama.cpp's reference rounding.
        kind = "q4" if route == "int4" else "q8"
        parts = [
            (to_kind(quantized[n], kind) if route == "int4" else quantized[n])
            if n in quantized
            else quantize(_hf(n, self.weights), kind)
            for n in names
        ]
        return self.linear.prepare_quantized(parts, route)

    def head_rows(self, embed_tokens: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """A quantized head's exact rows (fp32, by token id), for `head`'s refinement: a tied
        head's are the embedding rows; an untied one keeps its checkpoint blocks and dequantizes rows."""
        if self.routes["lm_head"] == "dequantized":
            return None
        if self.config.tie_word_embeddings:
            return lambda ids: embed_tokens[ids].float()
        stored = self.quantized.get("lm_head.weight") or quantize(_hf("lm_head.weight", self.weights), "q8")
        return lambda ids: dequantize(stored.rows(ids.reshape(-1))).reshape(*ids.shape, -1)

    def layer(self, i: int) -> LayerWeights:
        config, groups, take, fused, matrix = self.config, self.groups, self.take, self.fused, self.matrix
        p = f"model.layers.{i}."
        qk_norm = None
        if config.qk_norm:  # one weight row per head, q's heads first: a single norm call over q and k
            qk_norm = torch.cat(
                [
                    take(p + "self_attn.q_norm.weight")[None].expand(config.num_heads, -1),
                    take(p + "self_attn.k_norm.weight")[None].expand(config.num_kv_heads, -1),
                ]
            )
        return LayerWeights(
            attn_norm=take(p + "input_layernorm.weight"),
            qkv=matrix(p + "attn_qkv", lambda: fused(*groups[p + "attn_qkv"])),
            o=matrix(p + "attn_o", lambda: take(p + "self_attn.o_proj.weight")),
            mlp_norm=take(p + "post_attention_layernorm.weight"),
            gate_up=matrix(p + "mlp_gate_up", lambda: fused(*groups[p + "mlp_gate_up"])),
            down=matrix(p + "mlp_down", lambda: take(p + "mlp.down_proj.weight")),
            qkv_bias=fused(*(p + f"self_attn.{n}_proj.bias" for n in "qkv")) if config.qkv_bias else None,
            o_bias=take(p + "self_attn.o_proj.bias") if config.o_bias else None,
            qk_norm=qk_norm,
        )


class LlamaModel:
    """The decoder's weights plus a forward that reads and writes a `KVCache`.

    `weights` uses HF names (`model.layers.0.self_attn.q_proj.weight`, ...). Only the layers
    in `layers` are kept (a layer-sharded member need not hold the others). Every tensor the
    config implies (`shapes.weight_shapes`) must be there with its shape: a checkpoint that
    does not match its config.json is refused with the tensor's name, never reshaped.

    `routes` (`weight_routes.plan`) says how each matrix group is held: "dequantized" (float,
    from `weights`), or "int4"/"int8" (torch's weight-only kernels), built from `quantized`
    (the checkpoint's blocks, by HF name) where it holds the part, else quantized from
    `weights`. The embedding rows are always float (a lookup, not a product).
    """

    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, torch.Tensor],
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
        layers: range | None = None,
        quantized: Mapping[str, QuantizedTensor] | None = None,
        routes: Mapping[str, str] | None = None,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.config = config
        # A tensor-parallel rank (model/layers/tensor_parallel.py): `config` is its share, and
        # `reduce` sums o_proj's and down_proj's partial products over the group (an all_reduce).
        self.reduce = reduce
        self.dtype = dtype
        self.device = torch.device(device)
        self.layer_range = range(config.num_layers) if layers is None else layers
        if self.layer_range.start < 0 or self.layer_range.stop > config.num_layers or self.layer_range.step != 1:
            raise ValueError(f"layers {self.layer_range} outside the model's range(0, {config.num_layers})")

        quantized = quantized or {}
        check_weights(config, weights, self.layer_range, quantized)
        groups = matrix_groups(config, self.layer_range)
        self.routes = {group: (routes or {}).get(group, "dequantized") for group in groups}

        self.linear = Linear(self.device, dtype)
        build = _Weights(config, weights, quantized, groups, self.routes, self.linear)
        self.embed_tokens = build.take("model.embed_tokens.weight")
        self.norm = build.take("model.norm.weight")
        # Tied: a packed or quantized head is a second copy (the embedding lookup needs the plain rows).
        self.lm_head = build.matrix(
            "lm_head", lambda: self.embed_tokens if config.tie_word_embeddings else build.take("lm_head.weight")
        )
        # The native kernel's logits are already fp32 sums of the exact values: nothing to refine.
        self._head_rows = None if isinstance(self.lm_head, BlockMatrix) else build.head_rows(self.embed_tokens)
        self.layers: dict[int, LayerWeights] = {i: build.layer(i) for i in self.layer_range}
        freq_factors = weights.get("rope_freqs.weight")
        self.inv_freq = inverse_frequencies(config, freq_factors).to(self.device)
        self.rope_scale = attention_scaling(config)
        if self.device.type == "cpu":  # load (or build) the decode kernel now, not in the first request's step
            native.available()

    # ---- the three stages ------------------------------------------------------------------

    @torch.inference_mode()
    def embed(self, token_ids: torch.Tensor | Sequence[int] | Sequence[Sequence[int]]) -> torch.Tensor:
        """Hidden states `[B, T, hidden]` of token ids `[B, T]` (or `[T]`, taken as B=1)."""
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device)
        if ids.dim() == 1:
            ids = ids[None]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size):
            raise ValueError(f"token id outside vocabulary 0..{self.config.vocab_size - 1}: {ids.min()}..{ids.max()}")
        return F.embedding(ids, self.embed_tokens)

    @torch.inference_mode()
    def run_layers(
        self,
        hidden: torch.Tensor,
        layers: range,
        cache: KVCache,
        slots: Sequence[int],
        positions: Sequence[int],
    ) -> torch.Tensor:
        """Run decoder layers `layers` over `hidden [B, T, hidden]`; returns the new hidden state.

        Row b's T tokens sit at positions `positions[b] .. positions[b]+T-1` of slot `slots[b]`:
        their K/V are written there, and they attend to that slot's positions 0..their own
        (so positions before `positions[b]` must already hold this request's KV).
        """
        plan = self._plan(hidden, cache, slots, positions)
        for layer in layers:
            hidden = self._layer(hidden, layer, cache, plan)
        return hidden

    @torch.inference_mode()
    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits (fp32) of hidden states `[..., hidden]` after the final norm.

        A quantized head on torch's int4 kernel gives bf16 logits: logits of 16-32 are
        then 0.125 apart, enough to swap near-tied tokens that the dequantized fp32 model keeps
        apart. So the `REFINED_LOGITS` largest are recomputed in fp32 from the exact weight
        rows (a gather and a dot: tens of microseconds): greedy, top-k and the head of top-p
        see fp32 logits; the rest, whose probabilities are small, keep the kernel's. (A head on the
        native block kernel gives fp32 logits of the exact values: no refinement.)"""
        eps = self.config.rms_norm_eps
        fused = self._fused() and hidden.is_contiguous()
        normed = native.rms_norm(hidden, self.norm, eps) if fused else _rms_norm(hidden, self.norm, eps)
        logits = self.linear(normed, self.lm_head, torch.float32)
        if self._head_rows is None:
            return logits
        top = logits.topk(min(REFINED_LOGITS, logits.shape[-1]), dim=-1).indices
        exact = (self._head_rows(top) * normed.float()[..., None, :]).sum(-1)
        return logits.scatter(-1, top, exact)

    # ---- conveniences --------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(
        self,
        token_ids: Sequence[int] | torch.Tensor,
        cache: KVCache,
        slot: int,
        layers_per_chunk: int | None = None,
        on_chunk: Callable[[range], None] | None = None,
        start: int = 0,
        on_final: Callable[[torch.Tensor], None] | None = None,
        logits: bool = True,
    ) -> torch.Tensor:
        """Write the KV of positions 0..n-1 into `slot` and return the last position's logits `[vocab]`
        (`on_final` gets the computed positions' final hidden states `[n - start, hidden]` first;
        `logits=False`: a chunk of a longer prompt, whose head is not run: an empty tensor).

        Layers run in chunks of `layers_per_chunk`; after each chunk, whose KV is then final in
        the cache, `on_chunk(layer_range)` is called (the transfer pushes that chunk from there
        while the next chunk computes). Runs over the layers the cache holds.

        `start` > 0: positions 0..start-1 already hold this prompt's KV (a cached prefix,
        kv/prefix_store.py); only tokens start.. are computed, attending over all of it.
        """
        ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
        n = ids.numel()
        if n == 0:
            raise ValueError("prefill needs at least one token")
        if not 0 <= start < n:
            raise ValueError(f"prefill start {start} must leave at least one of the prompt's {n} tokens to compute")
        room = _room(cache, slot)
        if n > room:
            raise ValueError(f"prompt of {n} tokens exceeds the KV slot's max_len {room}")
        layers = cache.layout.layer_range
        step = layers_per_chunk or len(layers)
        if step <= 0:
            raise ValueError(f"layers_per_chunk must be positive, got {layers_per_chunk}")
        hidden = self.embed(ids[start:])
        plan = self._plan(hidden, cache, [slot], [start])
        for start in range(layers.start, layers.stop, step):
            chunk = range(start, min(start + step, layers.stop))
            for layer in chunk:
                hidden = self._layer(hidden, layer, cache, plan)
            if on_chunk is not None:
                on_chunk(chunk)
        if on_final is not None:
            on_final(hidden[0])
        return self.head(hidden[0, -1]) if logits else hidden.new_empty(0)

    @torch.inference_mode()
    def prefill_batch(
        self,
        prompts: Sequence[Sequence[int]],
        cache: KVCache,
        slots: Sequence[int],
        layers_per_chunk: int | None = None,
        on_chunk: Callable[[range], None] | None = None,
        starts: Sequence[int] | None = None,
        on_final: Callable[[torch.Tensor], None] | None = None,
        logits: bool = True,
    ) -> torch.Tensor:
        """`prefill` of several prompts in one forward pass: logits `[len(prompts), vocab]`
        (`on_final`: the packed final hidden states of every computed position, prompt after prompt;
        `logits=False`: the head is not run, an empty tensor — a tensor-parallel rank past 0).

        `starts[i]` > 0: prompt i's first `starts[i]` positions already hold its KV (a cached
        prefix); only the rest is computed.

        The prompts are packed into one row of all their tokens (no padding): every matrix
        product runs once over all of them, and attention runs per prompt over its own slot
        (causal, nothing crosses prompts). Prompt `i`'s KV goes to positions 0.. of
        `slots[i]`; `on_chunk(layer_range)` is called after each layer chunk, when that chunk's
        KV of every prompt is final. Equal, up to summation order, to prefilling each alone.
        """
        if len(prompts) != len(slots) or not prompts:
            raise ValueError(
                f"prefill_batch needs one slot per prompt and at least one prompt, got "
                f"{len(prompts)} prompts and {len(slots)} slots"
            )
        ids = [torch.as_tensor(p, dtype=torch.long).reshape(-1) for p in prompts]
        for i, p in enumerate(ids):
            if p.numel() == 0:
                raise ValueError(f"prompt {i} of the batch has no tokens")
            room = _room(cache, slots[i])
            if p.numel() > room:
                raise ValueError(f"prompt {i} of {p.numel()} tokens exceeds the KV slot's max_len {room}")
        layers = cache.layout.layer_range
        step = layers_per_chunk or len(layers)
        if step <= 0:
            raise ValueError(f"layers_per_chunk must be positive, got {layers_per_chunk}")
        first = [0] * len(ids) if starts is None else [int(x) for x in starts]
        if len(first) != len(ids) or any(not 0 <= f < p.numel() for f, p in zip(first, ids)):
            raise ValueError(f"starts {first} must leave at least one token of each prompt to compute")
        hidden = self.embed(torch.cat([p[f:] for f, p in zip(first, ids)]))
        lengths = [int(p.numel()) - f for f, p in zip(first, ids)]
        plan = self._packed_plan(cache, list(slots), first, lengths)
        for start in range(layers.start, layers.stop, step):
            chunk = range(start, min(start + step, layers.stop))
            for layer in chunk:
                hidden = self._layer(hidden, layer, cache, plan)
            if on_chunk is not None:
                on_chunk(chunk)
        if on_final is not None:
            on_final(hidden[0])
        if not logits:
            return hidden.new_empty(0)
        last = torch.tensor([seg.stop - 1 for seg in plan.segments], device=self.device)
        return self.head(hidden[0, last])

    @torch.inference_mode()
    def decode_step(
        self,
        cache: KVCache,
        slots: Sequence[int],
        positions: Sequence[int],
        token_ids: Sequence[int],
    ) -> torch.Tensor:
        """One token for each of a batch of slots: logits `[B, vocab]`.

        `token_ids[b]` is written at `positions[b]` of `slots[b]` and attends over 0..positions[b].
        """
        if not (len(slots) == len(positions) == len(token_ids)) or not slots:
            raise ValueError(
                f"decode_step needs equally long, non-empty slots/positions/token_ids, got "
                f"{len(slots)}/{len(positions)}/{len(token_ids)}"
            )
        hidden = self.embed([[t] for t in token_ids])
        hidden = self.run_layers(hidden, cache.layout.layer_range, cache, slots, positions)
        return self.head(hidden[:, 0])

    # ---- internals ---------------------------------------------------------------------------

    def _plan(
        self, hidden: torch.Tensor, cache: KVCache | PagedKVCache, slots: Sequence[int], positions: Sequence[int]
    ) -> _StepPlan | PagedPlan:
        if hidden.dim() != 3:
            raise ValueError(f"hidden must be [batch, tokens, hidden], got shape {tuple(hidden.shape)}")
        batch, tokens = hidden.shape[0], hidden.shape[1]
        if len(slots) != batch or len(positions) != batch:
            raise ValueError(f"{batch} rows but {len(slots)} slots and {len(positions)} positions")
        if isinstance(cache, PagedKVCache):
            if cache.dtype != self.dtype:
                raise ValueError(f"KV cache dtype {cache.dtype} differs from the model's {self.dtype}")
            pos = torch.as_tensor(list(positions), dtype=torch.long)[:, None] + torch.arange(tokens)[None]
            cos, sin = cos_sin(self.inv_freq, pos.to(self.device), self.dtype, self.rope_scale)
            return paged_attention.batch_plan(
                cache, slots, positions, tokens, cos[:, :, None], sin[:, :, None], pos.to(self.device)
            )
        if len(set(slots)) != batch:
            raise ValueError(f"a slot appears twice in one batch: {list(slots)}")
        layout = cache.layout
        for slot, pos in zip(slots, positions):
            if not 0 <= slot < layout.num_slots:
                raise IndexError(f"slot {slot} outside pool of {layout.num_slots} slots")
            if pos < 0 or pos + tokens > layout.max_len:
                raise IndexError(f"positions {pos}..{pos + tokens - 1} outside the slot's max_len {layout.max_len}")
        if cache.dtype != self.dtype:
            raise ValueError(f"KV cache dtype {cache.dtype} differs from the model's {self.dtype}")
        starts = torch.tensor(list(positions), dtype=torch.long)
        pos = starts[:, None] + torch.arange(tokens)[None]
        cos, sin = cos_sin(self.inv_freq, pos.to(self.device), self.dtype, self.rope_scale)
        kernel = None
        if tokens == 1:  # a slot is one block of max_len tokens
            kernel = native.rows_for([[s] for s in slots], [p + 1 for p in positions], layout.head_dim, self.device)
        return _StepPlan(
            slots=torch.tensor(list(slots), dtype=torch.long, device=self.device),
            positions=pos.to(self.device),
            first=(int(slots[0]), int(positions[0])),
            cos=cos[:, :, None],
            sin=sin[:, :, None],
            runs=() if kernel is not None else self._runs(list(slots), list(positions), tokens),
            tokens=tokens,
            kernel=kernel,
        )

    def _packed_plan(
        self, cache: KVCache | PagedKVCache, slots: list[int], starts: list[int], lengths: list[int]
    ) -> _StepPlan | PagedPlan:
        """The plan of prompts packed into one row: prompt i's `lengths[i]` tokens go to
        positions `starts[i]`.. of `slots[i]`."""
        if isinstance(cache, PagedKVCache):
            if cache.dtype != self.dtype:
                raise ValueError(f"KV cache dtype {cache.dtype} differs from the model's {self.dtype}")
            pos = torch.cat([start + torch.arange(n) for start, n in zip(starts, lengths)])
            cos, sin = cos_sin(self.inv_freq, pos[None].to(self.device), self.dtype, self.rope_scale)
            return paged_attention.packed_plan(
                cache, slots, starts, lengths, cos[:, :, None], sin[:, :, None], pos.to(self.device)
            )
        if len(set(slots)) != len(slots):
            raise ValueError(f"a slot appears twice in one batch: {slots}")
        layout = cache.layout
        for slot, start, n in zip(slots, starts, lengths):
            if not 0 <= slot < layout.num_slots:
                raise IndexError(f"slot {slot} outside pool of {layout.num_slots} slots")
            if start < 0 or start + n > layout.max_len:
                raise IndexError(f"positions {start}..{start + n - 1} outside the slot's max_len {layout.max_len}")
        if cache.dtype != self.dtype:
            raise ValueError(f"KV cache dtype {cache.dtype} differs from the model's {self.dtype}")
        segments, offset = [], 0
        for slot, start, n in zip(slots, starts, lengths):
            mask = None
            if start:
                key_pos = torch.arange(start + n)
                mask = (key_pos[None, :] <= (start + torch.arange(n))[:, None])[None, None].to(self.device)
            segments.append(_Segment(offset, offset + n, slot, start, mask))
            offset += n
        pos = torch.cat([start + torch.arange(n) for start, n in zip(starts, lengths)])
        token_slots = torch.cat([torch.full((n,), slot, dtype=torch.long) for slot, n in zip(slots, lengths)])
        cos, sin = cos_sin(self.inv_freq, pos[None].to(self.device), self.dtype, self.rope_scale)
        return _StepPlan(
            slots=token_slots.to(self.device),
            positions=pos.to(self.device),
            first=(slots[0], starts[0]),
            cos=cos[:, :, None],
            sin=sin[:, :, None],
            runs=(),
            tokens=offset,
            segments=tuple(segments),
        )

    def _runs(self, slots: list[int], positions: list[int], tokens: int) -> tuple[_Run, ...]:
        """Split the batch into maximal runs of rows whose slots are consecutive.

        One SDPA call per run reads the run's KV as a strided view of the pool (no copy).
        Keys past a row's own length inside that view are masked out. A decode step (one token
        per row) runs each row alone over exactly its own keys instead: padding a row to its
        neighbours' length changes the last bits of its attention, which the quantized route's
        bf16 activations turn into other tokens (batch invariance: model/layers/paged_attention.py).
        """
        runs: list[_Run] = []
        start = 0
        for b in range(1, len(slots) + 1):
            if b < len(slots) and slots[b] == slots[b - 1] + 1 and tokens > 1:
                continue
            rows = range(start, b)
            ends = [positions[r] + tokens for r in rows]
            key_len = max(ends)
            plain = len(rows) == 1 and (tokens == 1 or positions[start] == 0)
            mask = None
            if not plain:
                key_pos = torch.arange(key_len)
                query_pos = torch.tensor([positions[r] for r in rows])[:, None] + torch.arange(tokens)[None]
                mask = (key_pos[None, None, :] <= query_pos[:, :, None])[:, None].to(self.device)
            runs.append(_Run(start, b, slots[start], key_len, mask))
            start = b
        return tuple(runs)

    def _layer(self, x: torch.Tensor, layer: int, cache: KVCache, plan: _StepPlan) -> torch.Tensor:
        w = self.layers.get(layer)
        if w is None:
            raise IndexError(f"layer {layer} not loaded (this model holds {self.layer_range})")
        cfg = self.config
        batch, tokens, _ = x.shape
        heads, kv_heads, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

        q, k, v = self._qkv(x, w, plan)

        if isinstance(plan, PagedPlan):
            attn = paged_attention.write_and_attend(
                q, k, v, cache.keys(layer), cache.values(layer), plan, heads, kv_heads, head_dim
            )
            return self._finish_layer(x, attn, w)
        keys, values = cache.keys(layer), cache.values(layer)  # [slot, token, kv_head, head_dim]
        if plan.segments:
            keys[plan.slots, plan.positions] = k[0]
            values[plan.slots, plan.positions] = v[0]
        elif batch == 1:
            s, p = plan.first
            keys[s, p : p + tokens] = k[0]
            values[s, p : p + tokens] = v[0]
        else:
            keys[plan.slots[:, None], plan.positions] = k
            values[plan.slots[:, None], plan.positions] = v

        if plan.kernel is not None:  # [slot, token, kv_head, head_dim]: a slot is one block
            return self._finish_layer(x, plan.kernel.attend(q, keys, values), w)
        attn = self._attend(q, keys, values, plan)
        return self._finish_layer(x, attn, w)

    def _fused(self) -> bool:
        """Whether a layer's elementwise steps run as the native ops (model/layers/native.py)."""
        return self.device.type == "cpu" and native.available()

    def _qkv(
        self, x: torch.Tensor, w: LayerWeights, plan: _StepPlan | PagedPlan
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Attention norm, the QKV projection and RoPE: q `[B, T, heads, D]`, k and v `[B, T,
        kv_heads, D]`."""
        cfg = self.config
        batch, tokens, _ = x.shape
        heads, kv_heads, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if self._fused():  # the same steps as below, fused
            h = native.rms_norm(x, w.attn_norm, cfg.rms_norm_eps)
            qkv = self.linear(h, w.qkv, bias=w.qkv_bias)
            return native.rope_qkv(qkv, plan.cos, plan.sin, heads, kv_heads, w.qk_norm, cfg.rms_norm_eps)
        h = _rms_norm(x, w.attn_norm, cfg.rms_norm_eps)
        qkv = self.linear(h, w.qkv, bias=w.qkv_bias)
        qk = qkv[..., : (heads + kv_heads) * head_dim].view(batch, tokens, heads + kv_heads, head_dim)
        if w.qk_norm is not None:  # qwen3: RMSNorm over each head's head_dim, before RoPE
            qk = _rms_norm(qk, w.qk_norm, cfg.rms_norm_eps)
        # Q and K rotate together (one set of ops); SDPA's fast kernels need the contiguous result.
        qk = apply_rotary(qk, plan.cos, plan.sin)
        v = qkv[..., (heads + kv_heads) * head_dim :].view(batch, tokens, kv_heads, head_dim)
        return qk[:, :, :heads], qk[:, :, heads:], v

    def _finish_layer(self, x: torch.Tensor, attn: torch.Tensor, w: LayerWeights) -> torch.Tensor:
        """Output projection, residual, MLP: everything of a layer after attention."""
        eps, reduce = self.config.rms_norm_eps, self.reduce or _same
        if self._fused():  # the same steps as below, fused
            x, h = native.add_rms_norm(x, reduce(self.linear(attn, w.o, bias=w.o_bias)), w.mlp_norm, eps)
            return x + reduce(self.linear(native.silu_mul(self.linear(h, w.gate_up)), w.down))
        x = x + reduce(self.linear(attn, w.o, bias=w.o_bias))
        h = _rms_norm(x, w.mlp_norm, eps)
        gate, up = self.linear(h, w.gate_up).chunk(2, dim=-1)
        return x + reduce(self.linear(F.silu(gate) * up, w.down))

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, plan: _StepPlan) -> torch.Tensor:
        """Attention of q `[B, T, heads, head_dim]` over each row's slot; returns `[B, T, heads * head_dim]`."""
        cfg = self.config
        heads, kv_heads, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        tokens = q.shape[1]
        outs = []
        if plan.segments:  # packed prompts: each attends over its own slot
            for seg in plan.segments:
                n, end = seg.stop - seg.start, seg.position + seg.stop - seg.start
                if native.prefill_serves(q[0], keys[seg.slot], values[seg.slot]):  # seg.mask is its rule
                    attn = native.causal_attention(
                        q[0, seg.start : seg.stop], keys[seg.slot, :end], values[seg.slot, :end]
                    )
                    outs.append(attn[None])
                    continue
                kr = keys[seg.slot : seg.slot + 1, :end].transpose(1, 2)
                vr = values[seg.slot : seg.slot + 1, :end].transpose(1, 2)
                out = F.scaled_dot_product_attention(
                    q[:, seg.start : seg.stop].transpose(1, 2),
                    kr,
                    vr,
                    attn_mask=seg.mask,
                    is_causal=seg.mask is None,
                    enable_gqa=heads != kv_heads,
                )
                outs.append(out.transpose(1, 2).reshape(1, n, heads * head_dim))
            return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        for run in plan.runs:
            n = run.row_stop - run.row_start
            q_run = q[run.row_start : run.row_stop]
            kr = keys[run.slot_start : run.slot_start + n, : run.key_len].transpose(1, 2)
            vr = values[run.slot_start : run.slot_start + n, : run.key_len].transpose(1, 2)
            if tokens == 1:
                # [rows, kv_heads, group, head_dim]: the group plays the query-length role.
                qr = q_run.reshape(n, kv_heads, heads // kv_heads, head_dim)
                outs.append(
                    F.scaled_dot_product_attention(qr, kr, vr, attn_mask=run.mask).reshape(n, 1, heads * head_dim)
                )
            elif native.prefill_serves(q[0], keys[0], values[0]):  # run.mask is the same causal rule
                ends = (plan.positions[run.row_start : run.row_stop, -1] + 1).tolist()
                rows = zip(range(run.slot_start, run.slot_start + n), ends, strict=True)
                attn = [
                    native.causal_attention(q_run[i], keys[slot, :end], values[slot, :end])
                    for i, (slot, end) in enumerate(rows)
                ]
                outs.append(torch.stack(attn))
            else:
                out = F.scaled_dot_product_attention(
                    q_run.transpose(1, 2),
                    kr,
                    vr,
                    attn_mask=run.mask,
                    is_causal=run.mask is None,
                    enable_gqa=heads != kv_heads,
                )
                outs.append(out.transpose(1, 2).reshape(n, tokens, heads * head_dim))
        return outs[0] if len(outs) == 1 else torch.cat(outs)
