"""The 2-core CPU hardware profile the planner's unit tests plan against (bf16, SmolLM2-sized
numbers in the range benchmarks/README.md measured), defined once for all of them."""

from __future__ import annotations

from pdserve_operator.planner import HardwareProfile

TEST_CPU = HardwareProfile(
    name="cpu",
    device="cpu",
    dtype="bfloat16",
    matmul_flops=3e11,
    attention_flops=1e11,
    memory_bandwidth=1.4e10,
    link_bandwidth=2e9,
    step_overhead_s=1e-3,
    layer_overhead_s=2e-4,
    sequence_overhead_s=2e-5,
    overlap_compute_memory=False,
    overlap_transfer=False,
)
