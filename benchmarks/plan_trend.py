"""The seeds' P:D table predicted with the published Ascend 910B profile: does TPOT fall from 1P1D to 2P4D?

The seeds (shared/seeds/, in Chinese) give, for LLaMA-7B on Ascend 910 with 4,096-token
prompts and 256 output tokens, TPOT 27 ms (1P1D), 14 ms (1P2D), 8 ms (1P4D), 8 ms (2P4D).
Their figures are not a measurement we can reproduce (no NPU here); what `pdserve plan` must
reproduce is the trend. The same offered load goes to every configuration (the rows differ in
replicas, not in traffic), at a few load levels, and with the three HBM bandwidths public
sources give for the 910B, because that number is the least certain one of the profile.

    python benchmarks/plan_trend.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "operator")]

from pdserve_operator.planner import SLO, LengthDistribution, ServingModel, Workload, bundled_profile, predict  # noqa: E402
from pdserve_operator.planner.model_shape import LLAMA_7B  # noqa: E402

SEEDS = {(1, 1): (4.2, 27), (1, 2): (4.2, 14), (1, 4): (4.2, 8), (2, 4): (2.3, 8)}  # prefill latency s, TPOT ms
PROMPT, OUTPUT = 4096, 256


def main() -> int:
    base = bundled_profile("ascend-910b")
    workload = Workload(
        arrival_rate=0,
        prompt_tokens=LengthDistribution(fixed=PROMPT),
        output_tokens=LengthDistribution(fixed=OUTPUT),
        slo=SLO(quantile=0.99),
    )
    print(
        f"LLaMA-7B, {PROMPT}-token prompts, {OUTPUT} output tokens; profile {base.name} "
        f"(fp16 {base.matmul_flops / 1e12:.0f} TFLOPS x {base.compute_efficiency}, "
        f"HBM x {base.memory_efficiency}, {base.memory_capacity_bytes / 1e9:.0f} GB)"
    )
    falls = True
    for bandwidth in (1.6e12, 1.2e12, 0.9e12):
        profile = base.with_overrides(memory_bandwidth=bandwidth)
        model = ServingModel(LLAMA_7B, profile, max_len=PROMPT + OUTPUT)
        print(
            f"\nHBM {bandwidth / 1e12:.1f} TB/s: prefill of one prompt {model.prefill_service_seconds(PROMPT):.2f} s, "
            f"decode step at batch 1 {model.decode_step_seconds(1, PROMPT + OUTPUT / 2) * 1e3:.1f} ms, "
            f"{model.decode_capacity} requests per decode"
        )
        print(f"{'rate':>6}  " + "  ".join(f"{p}P{d}D TPOT mean/p99 (TTFT p50)".rjust(30) for p, d in SEEDS))
        for rate in (0.12, 0.5, 1.0, 1.5):
            cells, tpots = [], []
            for p, d in SEEDS:
                pred = predict(model, workload.with_rate(rate), p, d)
                tpots.append(pred.tpot_mean_s)
                ttft = f"{pred.ttft_p50_s:.2f}s" if pred.prefill_utilization < 1 else "overload"
                kv = "" if pred.kv_fits else " KV!"
                cells.append(f"{pred.tpot_mean_s * 1e3:.1f}/{pred.tpot_q_s * 1e3:.1f} ms ({ttft}){kv}".rjust(30))
            trend = all(a >= b - 1e-9 for a, b in zip(tpots, tpots[1:])) and tpots[0] > tpots[-1]
            falls &= trend
            print(f"{rate:>5.2f}/s " + "  ".join(cells) + ("" if trend else "   <- not falling"))
    print(
        "\nthe seeds' table (LLaMA-7B on Ascend 910): "
        + ", ".join(f"{p}P{d}D {t} ms" for (p, d), (_, t) in SEEDS.items())
    )
    print(f"TPOT falls from 1P1D to 2P4D at every load and bandwidth: {'yes' if falls else 'NO'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
