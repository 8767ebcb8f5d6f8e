"""`pdserve plan`: how many prefill and decode replicas to start with, and the TTFT/TPOT to expect.

    pdserve plan --hardware ascend-910b --model llama-7b --rate 1.5 \\
                 --prompt-tokens 4096 --output-tokens 256 --ttft-ms 2000 --tpot-ms 30
    pdserve plan --hardware my-profile.yaml --model ./hf-folder --workload workload.yaml
    pdserve plan --profile [--out profile.yaml]     measure this machine's profile (torch)

Planning is the operator's planner (`pdserve_operator.planner`): pure, no torch. Lengths are
`N` (fixed), `LO-HI` (uniform) or a mixture `LO-HI:W,LO-HI:W`. A workload file (YAML/JSON)
holds `arrival_rate`, `prompt_tokens`, `output_tokens` and `slo` as `planner.Workload` does.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="prefill/decode counts and predicted TTFT/TPOT for a workload; --profile measures")
    p.add_argument(
        "--profile", action="store_true", help="measure this machine's hardware profile and write it (--out)"
    )
    p.add_argument(
        "--out", type=Path, default=Path("pdserve-profile.yaml"), help="where --profile writes (.yaml/.json)"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="--profile: torch threads (default: what `pdserve local` gives each of 1 prefill + 1 decode)",
    )
    p.add_argument(
        "--dtype",
        choices=["auto", "bfloat16", "float16", "float32"],
        default="auto",
        help="--profile: serving dtype (default auto, as `pdserve local`)",
    )
    p.add_argument(
        "--hardware", default="ascend-910b", help="a bundled profile name or a profile file (default ascend-910b)"
    )
    p.add_argument(
        "--model",
        default="smollm2-135m",
        help="built-in (smollm2-135m, llama-7b), an HF folder or config.json (default smollm2-135m)",
    )
    p.add_argument("--workload", type=Path, default=None, help="a workload file; the flags below override it")
    p.add_argument("--rate", type=float, default=None, help="requests per second (Poisson)")
    p.add_argument("--prompt-tokens", default=None, help="prompt lengths: N, LO-HI, or LO-HI:W,LO-HI:W")
    p.add_argument("--output-tokens", default=None, help="output lengths, same forms")
    p.add_argument("--ttft-ms", type=float, default=None)
    p.add_argument("--tpot-ms", type=float, default=None)
    p.add_argument("--quantile", type=float, default=None, help="SLO quantile (default 0.99)")
    p.add_argument("--max-len", type=int, default=None, help="tokens per slot (default: longest prompt + output)")
    p.add_argument("--slots", type=int, default=None, help="KV slots per decode (default: what device memory allows)")
    p.add_argument(
        "--prefill-tp",
        type=int,
        default=1,
        help="devices per prefill instance (tensor parallelism; spec.prefill.tensorParallelSize), default 1",
    )
    p.add_argument(
        "--decode-tp",
        type=int,
        default=1,
        help="devices per decode instance (tensor parallelism; spec.decode.tensorParallelSize), default 1",
    )
    p.add_argument("--min-prefill", type=int, default=1)
    p.add_argument("--max-prefill", type=int, default=16)
    p.add_argument("--min-decode", type=int, default=1)
    p.add_argument("--max-decode", type=int, default=16)
    p.add_argument("--min-ratio", type=float, default=None, help="lowest prefill:decode ratio allowed")
    p.add_argument("--max-ratio", type=float, default=None, help="highest prefill:decode ratio allowed")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run)


def parse_lengths(text: str):
    """`512`, `128-1024`, or `32-256:0.65,1024-2048:0.35` → a LengthDistribution."""
    from pdserve_operator.planner.workload import LengthDistribution, WeightedLength

    def one(part: str) -> LengthDistribution:
        lo, sep, hi = part.partition("-")
        if not sep:
            return LengthDistribution(fixed=int(lo))
        return LengthDistribution(uniform=(int(lo), int(hi)))

    try:
        if ":" not in text:
            return one(text.strip())
        parts = []
        for item in text.split(","):
            spec, _, weight = item.partition(":")
            parts.append(WeightedLength(weight=float(weight), dist=one(spec.strip())))
        return LengthDistribution(mixture=tuple(parts))
    except ValueError as exc:
        raise ValueError(f"lengths {text!r}: expected N, LO-HI or LO-HI:W,LO-HI:W ({exc})") from exc


def _workload(args: argparse.Namespace):
    import yaml

    from pdserve_operator.planner.workload import Workload

    data: dict = {}
    if args.workload is not None:
        data = yaml.safe_load(args.workload.read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"workload file {args.workload} must hold a mapping")
    if args.rate is not None:
        data["arrival_rate"] = args.rate
    for flag, key in (("prompt_tokens", "prompt_tokens"), ("output_tokens", "output_tokens")):
        value = getattr(args, flag)
        if value is not None:
            data[key] = parse_lengths(value).model_dump(exclude_none=True)
    slo = dict(data.get("slo") or {})
    for flag in ("ttft_ms", "tpot_ms", "quantile"):
        if getattr(args, flag) is not None:
            slo[flag] = getattr(args, flag)
    data["slo"] = slo
    missing = [k for k in ("arrival_rate", "prompt_tokens", "output_tokens") if k not in data]
    if missing:
        raise ValueError(
            f"the workload needs {', '.join(missing)} (flags --rate/--prompt-tokens/--output-tokens or --workload)"
        )
    return Workload.model_validate(data)


def run(args: argparse.Namespace) -> int:
    if args.profile:
        return _measure(args)
    from pydantic import ValidationError

    from pdserve_operator.planner import Bounds, plan_replicas

    try:
        workload = _workload(args)
        model = _serving_model(args, workload)
        bounds = Bounds(
            min_prefill=args.min_prefill,
            max_prefill=args.max_prefill,
            min_decode=args.min_decode,
            max_decode=args.max_decode,
            min_ratio=args.min_ratio,
            max_ratio=args.max_ratio,
        )
    except (ValueError, ValidationError, OSError) as exc:
        print(f"pdserve plan: {exc}", file=sys.stderr)
        return 2
    plan = plan_replicas(model, workload, bounds)
    q = f"p{round(workload.slo.quantile * 100, 2):g}"
    tp = (args.prefill_tp, args.decode_tp)
    if args.json:
        print(json.dumps(_result(plan, model, q, tp), indent=2))
    else:
        _print_plan(plan, model.shape.name, model.profile.name, workload.arrival_rate, q, tp)
    return 0 if plan.meets_slo else 1


def _serving_model(args: argparse.Namespace, workload: Any) -> Any:
    from pdserve_operator.planner import ModelShape, ServingModel, load_profile

    longest = max(n for n, _ in workload.prompt_tokens.points()) + max(n for n, _ in workload.output_tokens.points())
    return ServingModel(
        ModelShape.load(args.model),
        load_profile(args.hardware),
        max_len=args.max_len or longest,
        slots=args.slots,
        prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
    )


def _result(plan: Any, model: Any, q: str, tp: tuple[int, int]) -> dict[str, Any]:
    """The plan as JSON: counts, devices, and the predictions at the SLO's quantile `q`."""
    pred = plan.prediction
    return {
        "prefill": plan.prefill,
        "prefill_tensor_parallel": tp[0],
        "decode_tensor_parallel": tp[1],
        "devices": plan.prefill * tp[0] + plan.decode * tp[1],
        "decode": plan.decode,
        "meets_slo": plan.meets_slo,
        "reason": plan.reason,
        "model": model.shape.name,
        "hardware": model.profile.name,
        "predicted": {
            "ttft_p50_s": pred.ttft_p50_s,
            f"ttft_{q}_s": pred.ttft_q_s,
            "ttft_mean_s": pred.ttft_mean_s,
            "tpot_mean_s": pred.tpot_mean_s,
            f"tpot_{q}_s": pred.tpot_q_s,
            "prefill_utilization": pred.prefill_utilization,
            "decode_batch_mean": pred.decode_batch_mean,
            "decode_slots_mean": pred.decode_slots_mean,
            f"decode_slots_{q}": pred.decode_slots_q,
            "decode_capacity": pred.decode_capacity,
        },
    }


def _print_plan(plan: Any, model: str, hardware: str, rate: float, q: str, tp: tuple[int, int] = (1, 1)) -> None:
    """The plan as a person reads it: replicas, the predicted TTFT and TPOT, and why."""
    pred = plan.prediction
    cap = "unlimited" if pred.decode_capacity is None else str(pred.decode_capacity)
    print(f"{model} on {hardware}, {rate:g} req/s")
    each = [f" (tensor-parallel over {t} devices each)" if t > 1 else "" for t in tp]
    devices = plan.prefill * tp[0] + plan.decode * tp[1]
    print(
        f"start with: {plan.prefill} prefill{each[0]}, {plan.decode} decode{each[1]}: {devices} devices"
        + ("" if plan.meets_slo else "  (SLO NOT met within the bounds)")
    )
    print(
        f"TTFT  p50 {pred.ttft_p50_s * 1e3:,.0f} ms   {q} {pred.ttft_q_s * 1e3:,.0f} ms   "
        f"(prefill utilisation {pred.prefill_utilization:.2f})"
    )
    print(
        f"TPOT  mean {pred.tpot_mean_s * 1e3:,.1f} ms   {q} {pred.tpot_q_s * 1e3:,.1f} ms   "
        f"(decode batch {pred.decode_batch_mean:.1f}, slots {q} {pred.decode_slots_q} of {cap})"
    )
    print(f"why: {plan.reason}")


def _measure(args: argparse.Namespace) -> int:
    import os

    from pdserve_operator.planner import ModelShape
    from pdserve_worker.cli.hw_profile import measure
    from pdserve_worker.cli.local_deployment import auto_dtype

    try:
        shape = ModelShape.load(args.model)
    except ValueError as exc:
        print(f"pdserve plan: {exc}", file=sys.stderr)
        return 2
    dtype = auto_dtype() if args.dtype == "auto" else args.dtype
    threads = args.threads or max(1, len(os.sched_getaffinity(0)) // 2)
    profile = measure(shape, dtype, threads, progress=lambda line: print(line, file=sys.stderr, flush=True))
    profile.dump(args.out)
    print(str(args.out))
    return 0
