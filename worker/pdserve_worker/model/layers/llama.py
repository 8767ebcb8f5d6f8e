"""A LLaMA-family decoder in plain torch whose KV lives in an explicit, externally owned pool.

One forward serves every family `ModelConfig` describes (llama, mistral, qwen2, qwen3): they
differ in q/k/v (and o) biases, qwen3's per-head RMSNorm of q and k before RoPE, head_dim, GQA
and the rope scaling; each switch is applied where transformers' modeling code applies it, and
numerics mirror LlamaForCausalLM (RMSNorm in fp32, cos/sin in fp32 then cast, rotate-half RoPE).

The forward is split the way PD serving needs it: `embed` → `run_layers(range)` → `head`.
Prefill runs layer chunks and tells the transfer after each that its KV is final
(`prefill(..., on_chunk=...)`); a layer-sharded decode member runs only its range; `decode_step`
advances a batch of slots of different lengths by one token (continuous batching). The weights
are built by layer_weights.py, a layer's arithmetic is decoder_block.py, and attention over a
slot or paged pool is slot_attention.py or paged_attention.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve_worker.kv.cache import KVCache
from pdserve_worker.kv.paged import PagedKVCache
from pdserve_worker.model.config import ModelConfig
from pdserve_worker.model.layers import native, paged_attention, slot_attention
from pdserve_worker.model.layers.decoder_block import DecoderBlock, rms_norm
from pdserve_worker.model.layers.layer_weights import LayerWeights, WeightBuilder, check_weights
from pdserve_worker.model.layers.matmul import BlockMatrix, Linear
from pdserve_worker.model.layers.paged_attention import PagedPlan
from pdserve_worker.model.layers.quant import QuantizedTensor
from pdserve_worker.model.layers.rope import attention_scaling, cos_sin, inverse_frequencies
from pdserve_worker.model.layers.slot_attention import SlotPlan
from pdserve_worker.model.layers.weight_routes import groups as matrix_groups

# Logits a quantized head recomputes in fp32 from the exact rows (see `LlamaModel.head`).
REFINED_LOGITS = 16


def _room(cache: KVCache | PagedKVCache, slot: int) -> int:
    """Tokens the KV of `slot` can hold: a slot's max_len, or its bound block table's capacity."""
    return cache.capacity(slot) if isinstance(cache, PagedKVCache) else cache.layout.max_len


@dataclass(frozen=True)
class PrefillOutputs:
    """What a prefill returns besides the KV it writes: the last position's logits (`logits`
    False: a chunk of a longer prompt, or a tensor-parallel rank past 0, whose head is not run:
    an empty tensor), and, to `on_final` first, the computed positions' final hidden states."""

    logits: bool = True
    on_final: Callable[[torch.Tensor], None] | None = None


@dataclass(frozen=True)
class ModelPart:
    """What of the model one process holds, and how (`LlamaModel`'s optional arguments).

    `layers`: the layers kept (None: all). `quantized`: the checkpoint's quantized blocks by HF
    name. `routes` (`weight_routes.plan`): how each matrix group is held (missing: "dequantized").
    `reduce`: on a tensor-parallel rank, the sum of o_proj's and down_proj's partial products
    over the group (an all_reduce; model/layers/tensor_parallel.py)."""

    layers: range | None = None
    quantized: Mapping[str, QuantizedTensor] | None = None
    routes: Mapping[str, str] | None = None
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None


class LlamaModel:
    """The decoder's weights plus a forward that reads and writes a `KVCache`.

    `weights` uses HF names (`model.layers.0.self_attn.q_proj.weight`, ...). Only the layers
    in `part.layers` are kept (a layer-sharded member need not hold the others). Every tensor the
    config implies (`shapes.weight_shapes`) must be there with its shape: a checkpoint that
    does not match its config.json is refused with the tensor's name, never reshaped.

    `part.routes` (`weight_routes.plan`) says how each matrix group is held: "dequantized" (float,
    from `weights`), or "int4"/"int8" (torch's weight-only kernels), built from `part.quantized`
    (the checkpoint's blocks, by HF name) where it holds the part, else quantized from
    `weights`. The embedding rows are always float (a lookup, not a product).
    """

    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, torch.Tensor],
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
        part: ModelPart | None = None,
    ) -> None:
        part = part or ModelPart()
        layers, quantized, routes, reduce = part.layers, part.quantized, part.routes, part.reduce
        self.config = config  # a tensor-parallel rank's share of the model, on such a rank
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
        self.block = DecoderBlock(config, self.linear, self.device, reduce)
        build = WeightBuilder(config, weights, quantized, groups, self.routes, self.linear)
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
        fused = self.block.fused() and hidden.is_contiguous()
        normed = native.rms_norm(hidden, self.norm, eps) if fused else rms_norm(hidden, self.norm, eps)
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
        outputs: PrefillOutputs = PrefillOutputs(),
    ) -> torch.Tensor:
        """Write the KV of positions 0..n-1 into `slot` and return the last position's logits `[vocab]`
        (`outputs.on_final` gets the computed positions' final hidden states `[n - start, hidden]`
        first; `outputs.logits` False: a chunk of a longer prompt, whose head is not run: an empty
        tensor).

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
        if outputs.on_final is not None:
            outputs.on_final(hidden[0])
        return self.head(hidden[0, -1]) if outputs.logits else hidden.new_empty(0)

    @torch.inference_mode()
    def prefill_batch(
        self,
        prompts: Sequence[Sequence[int]],
        cache: KVCache,
        slots: Sequence[int],
        layers_per_chunk: int | None = None,
        on_chunk: Callable[[range], None] | None = None,
        starts: Sequence[int] | None = None,
        outputs: PrefillOutputs = PrefillOutputs(),
    ) -> torch.Tensor:
        """`prefill` of several prompts in one forward pass: logits `[len(prompts), vocab]`
        (`outputs.on_final`: the packed final hidden states of every computed position, prompt
        after prompt; `outputs.logits` False: the head is not run, an empty tensor — a
        tensor-parallel rank past 0).

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
        if outputs.on_final is not None:
            outputs.on_final(hidden[0])
        if not outputs.logits:
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

    def _check_dtype(self, cache: KVCache | PagedKVCache) -> None:
        if cache.dtype != self.dtype:
            raise ValueError(f"KV cache dtype {cache.dtype} differs from the model's {self.dtype}")

    def _angles(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin `[B, T, 1, head_dim]` of positions `[B, T]`, on the model's device."""
        cos, sin = cos_sin(self.inv_freq, pos.to(self.device), self.dtype, self.rope_scale)
        return cos[:, :, None], sin[:, :, None]

    def _plan(
        self, hidden: torch.Tensor, cache: KVCache | PagedKVCache, slots: Sequence[int], positions: Sequence[int]
    ) -> SlotPlan | PagedPlan:
        if hidden.dim() != 3:
            raise ValueError(f"hidden must be [batch, tokens, hidden], got shape {tuple(hidden.shape)}")
        batch, tokens = hidden.shape[0], hidden.shape[1]
        if len(slots) != batch or len(positions) != batch:
            raise ValueError(f"{batch} rows but {len(slots)} slots and {len(positions)} positions")
        if not isinstance(cache, PagedKVCache):
            slot_attention.check_batch(cache, slots, positions, tokens)
        self._check_dtype(cache)
        pos = torch.as_tensor(list(positions), dtype=torch.long)[:, None] + torch.arange(tokens)[None]
        cos, sin = self._angles(pos)
        if isinstance(cache, PagedKVCache):
            return paged_attention.batch_plan(cache, slots, positions, tokens, cos, sin, pos.to(self.device))
        return slot_attention.batch_plan(cache, slots, positions, tokens, cos, sin, pos.to(self.device))

    def _packed_plan(
        self, cache: KVCache | PagedKVCache, slots: list[int], starts: list[int], lengths: list[int]
    ) -> SlotPlan | PagedPlan:
        """The plan of prompts packed into one row: prompt i's `lengths[i]` tokens go to
        positions `starts[i]`.. of `slots[i]`."""
        if not isinstance(cache, PagedKVCache):
            slot_attention.check_packed(cache, slots, starts, lengths)
        self._check_dtype(cache)
        pos = torch.cat([start + torch.arange(n) for start, n in zip(starts, lengths)])
        cos, sin = self._angles(pos[None])
        if isinstance(cache, PagedKVCache):
            return paged_attention.packed_plan(cache, slots, starts, lengths, cos, sin, pos.to(self.device))
        return slot_attention.packed_plan(cache, slots, starts, lengths, cos, sin, pos.to(self.device))

    def _layer(
        self, x: torch.Tensor, layer: int, cache: KVCache | PagedKVCache, plan: SlotPlan | PagedPlan
    ) -> torch.Tensor:
        w = self.layers.get(layer)
        if w is None:
            raise IndexError(f"layer {layer} not loaded (this model holds {self.layer_range})")
        return self.block(x, w, cache.keys(layer), cache.values(layer), plan)
