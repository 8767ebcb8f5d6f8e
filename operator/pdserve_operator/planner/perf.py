"""Service times of one replica: model shape × hardware profile → seconds.

A forward pass is the weight GEMMs plus attention over the KV, each bounded by its own
roofline, `combine(compute, memory)`: the max where a kernel overlaps its arithmetic with its
memory traffic (accelerators), the sum where it does not (`overlap_compute_memory` false: CPU),
plus fixed step, layer and sequence overheads. `prefill_seconds(n)` and
`decode_step_seconds(B, C)` (C: the context tokens of the whole batch) are that sum; a
prefill's service time adds the exposed KV push (all of it, or with `overlap_transfer` only the
last layer chunk's share). A tensor-parallel instance (`prefill_tp`, `decode_tp`) splits the
layers' FLOPs and weight reads t ways and adds two ring all_reduces per layer.
The formulas and why they hold: docs/planner.md; what they were checked against:
benchmarks/README.md ("Planner model").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from pdserve_operator.planner.model_shape import ModelShape
from pdserve_operator.planner.profile import HardwareProfile


@dataclass(frozen=True)
class ServingModel:
    shape: ModelShape
    profile: HardwareProfile
    max_len: int = 2048  # tokens a decode slot holds (prompt + output)
    slots: int | None = None  # KV slots per decode as configured; None: what memory allows
    layers_per_chunk: int = 4  # prefill's push granularity
    # Decode replicas on other hardware than prefill (a bandwidth-rich device for decode, a
    # compute-rich one for prefill); None: the same profile. Weights and KV use `profile`'s dtype.
    decode_profile: HardwareProfile | None = None
    prefill_tp: int = 1  # devices of one prefill instance (tensor parallelism)
    decode_tp: int = 1  # devices of one decode instance

    def __post_init__(self) -> None:
        for name in ("prefill_tp", "decode_tp"):
            size = getattr(self, name)
            if size not in self.shape.tensor_parallel_sizes():
                raise ValueError(
                    f"{name} {size} does not split {self.shape.name}'s {self.shape.num_heads} heads over "
                    f"{self.shape.num_kv_heads} KV heads; sizes that do: {self.shape.tensor_parallel_sizes()}"
                )
        if self.max_len < 2:
            raise ValueError(f"max_len must be >= 2, got {self.max_len}")
        if self.slots is not None and self.slots < 1:
            raise ValueError(f"slots must be >= 1, got {self.slots}")
        if self.layers_per_chunk < 1:
            raise ValueError(f"layers_per_chunk must be >= 1, got {self.layers_per_chunk}")
        if self.decode_profile is not None and self.decode_profile.dtype != self.profile.dtype:
            raise ValueError(
                f"decode profile dtype {self.decode_profile.dtype} differs from prefill's {self.profile.dtype}: "
                "the KV pushed must be read as written"
            )
        for profile, t in ((self.profile, self.prefill_tp), (self.decoder, self.decode_tp)):
            capacity, held = profile.memory_capacity_bytes, self.device_weight_bytes(t)
            if capacity is not None and held >= capacity * profile.memory_utilization:
                raise ValueError(
                    f"{self.shape.name} weights ({held / 1e9:.1f} GB per device at tensor-parallel {t}) do not fit "
                    f"in {profile.name}'s {capacity * profile.memory_utilization / 1e9:.1f} GB usable memory"
                )

    @property
    def decoder(self) -> HardwareProfile:
        """The profile decode replicas run on."""
        return self.decode_profile or self.profile

    # ---- sizes ---------------------------------------------------------------------------------

    @cached_property
    def weight_bytes(self) -> int:
        return self.shape.weight_bytes(self.profile.dtype_bytes)

    def device_weight_bytes(self, tp: int) -> float:
        """Weights one device of a `tp`-way instance holds (as `weight_bytes` counts them): its
        share of the layers, the head whole."""
        head = self.shape.head_params * self.profile.dtype_bytes
        return (self.weight_bytes - head) / tp + head

    @cached_property
    def kv_bytes_per_token(self) -> int:
        return self.shape.kv_bytes_per_token(self.profile.dtype_bytes)

    @cached_property
    def _decode_terms(self) -> tuple[float, float, float, float, float, float]:
        """Per-step constants: (fixed s, s per sequence, weight read s, KV read s per context
        token, GEMM s per sequence, attention s per context token): a decode step is linear in
        the batch and in the context on each side of each roofline."""
        p, s, t = self.decoder, self.shape, self.decode_tp
        # At decode_tp t each device reads 1/t of the layers' weights and of the KV (its heads;
        # replicas past t = KV heads read their copy) and does 1/t of their FLOPs; embedding and
        # head stay whole (model/layers/tensor_parallel.py). Two ring all_reduces per layer.
        kv_share = 1 / min(t, s.num_kv_heads)
        return (
            p.step_overhead_s + s.num_layers * p.layer_overhead_s + self._decode_all_reduce(0),
            s.num_layers * p.sequence_overhead_s + self._decode_all_reduce(1) - self._decode_all_reduce(0),
            self.device_weight_bytes(t) / p.effective_memory_bandwidth,
            self.kv_bytes_per_token * kv_share / p.effective_memory_bandwidth,
            (s.matmul_flops_per_token / t + s.head_flops) / p.effective_matmul_flops,
            s.attention_flops(1.0) / t / p.effective_attention_flops,
        )

    def _decode_all_reduce(self, batch: int) -> float:
        """A decode step's collectives at `decode_tp`: 2 ring all_reduces per layer of batch x hidden."""
        return self._ring_seconds(self.decode_tp, self.decoder, batch)

    def _ring_seconds(self, t: int, p: HardwareProfile, rows: int) -> float:
        if t == 1:
            return 0.0
        bandwidth = p.collective_bandwidth or p.link_bandwidth
        latency = p.link_latency_s if p.collective_latency_s is None else p.collective_latency_s
        ring = 2 * (t - 1) / t * rows * self.shape.hidden_size * p.dtype_bytes / bandwidth
        return 2 * self.shape.num_layers * (ring + latency)

    @property
    def decode_capacity(self) -> int | None:
        """Requests one decode holds at once: its slots, bounded by the memory left for KV.

        A slot reserves `max_len` positions (DESIGN.md's slot layout), so capacity counts
        requests, not tokens. None: no limit known.
        """
        by_memory = None
        capacity = self.decoder.memory_capacity_bytes
        if capacity is not None:  # (per device: at decode_tp each holds its heads' KV)
            free = capacity * self.decoder.memory_utilization - self.device_weight_bytes(self.decode_tp)
            per_request = self.max_len * self.kv_bytes_per_token / min(self.decode_tp, self.shape.num_kv_heads)
            by_memory = max(0, int(free // per_request))
        if self.slots is None:
            return by_memory
        return self.slots if by_memory is None else min(self.slots, by_memory)

    # ---- prefill -------------------------------------------------------------------------------

    @staticmethod
    def _combine(profile: HardwareProfile, compute: float, memory: float) -> float:
        return max(compute, memory) if profile.overlap_compute_memory else compute + memory

    def prefill_seconds(self, tokens: int) -> float:
        if tokens < 1:
            raise ValueError(f"a prompt has at least 1 token, got {tokens}")
        p, s, t = self.profile, self.shape, self.prefill_tp
        gemm = self._combine(
            p,
            (tokens * s.matmul_flops_per_token / t + s.head_flops) / p.effective_matmul_flops,
            self.device_weight_bytes(t) / p.effective_memory_bandwidth,
        )
        attention = (
            s.num_layers * p.attention_overhead_s + s.prefill_attention_flops(tokens) / t / p.effective_attention_flops
        )
        return (
            p.step_overhead_s + s.num_layers * p.layer_overhead_s + gemm + attention + self.all_reduce_seconds(tokens)
        )

    def all_reduce_seconds(self, tokens: int) -> float:
        """The prefill's collectives at `prefill_tp` devices: 2 ring all_reduces per layer."""
        return self._ring_seconds(self.prefill_tp, self.profile, tokens)

    @property
    def _push_links(self) -> int:
        """Links a prompt's KV goes over at once: one per rank holding distinct KV heads."""
        return min(self.prefill_tp, self.shape.num_kv_heads)

    def transfer_seconds(self, tokens: int) -> float:
        """The whole KV push of a prompt over the link(s)."""
        seconds = tokens * self.kv_bytes_per_token / self.profile.link_bandwidth / self._push_links
        return seconds + self.profile.link_latency_s

    def exposed_transfer_seconds(self, tokens: int) -> float:
        """The part of the push the prompt waits for after its prefill compute."""
        if not self.profile.overlap_transfer:
            return self.transfer_seconds(tokens)
        share = min(1.0, self.layers_per_chunk / self.shape.num_layers)
        seconds = tokens * self.kv_bytes_per_token * share / self.profile.link_bandwidth / self._push_links
        return seconds + self.profile.link_latency_s

    def prefill_service_seconds(self, tokens: int) -> float:
        """How long a prefill worker is busy with one prompt (compute + exposed push)."""
        return self.prefill_seconds(tokens) + self.exposed_transfer_seconds(tokens)

    # ---- decode --------------------------------------------------------------------------------

    def decode_step_seconds(self, batch: float, context_tokens: float) -> float:
        """One decode step of `batch` sequences holding `context_tokens` positions in all.

        Takes floats so the queueing model can ask for a mean batch; 0 sequences cost nothing.
        """
        if batch <= 0:
            return 0.0
        fixed, per_seq, mem, mem_ctx, comp_seq, comp_ctx = self._decode_terms
        gemm = self._combine(self.decoder, batch * comp_seq, mem)
        attention = self._combine(self.decoder, context_tokens * comp_ctx, context_tokens * mem_ctx)
        return fixed + batch * per_seq + gemm + attention

    def decode_tokens_per_second(self, batch: int, context_per_sequence: float) -> float:
        step = self.decode_step_seconds(batch, batch * context_per_sequence)
        return batch / step if step > 0 else math.inf
