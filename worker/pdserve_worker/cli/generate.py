"""`pdserve generate`: one prompt through the colocated engine, streamed to stdout.

The completion goes to stdout as it is generated; the last line on stderr is the run's speed
as key=value pairs (prefill tokens/s, decode ms/token), so scripts can parse it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from pdserve_worker.model.sampling.params import SamplingParams


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate a completion for one prompt (colocated, streamed to stdout)")
    given = p.add_mutually_exclusive_group(required=True)
    given.add_argument(
        "prompt_text", nargs="?", metavar="PROMPT", help="the prompt text (or the user message with --chat)"
    )
    given.add_argument("--prompt", default=None, help="the same, as a flag")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", default=None, help="system message for --chat (else the template's default)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float16", "float32"],
        help="compute dtype (default auto, as `pdserve local` and the API: bfloat16 where the CPU has "
        "native bf16, else float32)",
    )
    p.add_argument(
        "--weights",
        default="auto",
        choices=["auto", "dequantized", "int8", "int4"],
        help="how weight matrices are held (default auto: a GGUF's Q4_0/Q4_1/Q8_0 stay quantized on the CPU)",
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda[:N] or npu[:N]")
    p.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: the CPUs this process may use)"
    )
    p.set_defaults(func=run)


def resolve_dtype(dtype: str, device: str) -> str:
    """`auto` means what `pdserve local` and the workers it starts pick, so that the same greedy
    prompt gives the same text here and from the served API: bfloat16 where the CPU multiplies
    it natively, float32 elsewhere; bfloat16 on accelerators."""
    if dtype != "auto":
        return dtype
    if not device.startswith("cpu"):
        return "bfloat16"
    from pdserve_worker.cli.local_deployment import auto_dtype

    return auto_dtype()


def run(args: argparse.Namespace) -> int:
    import torch

    if args.prompt is None:  # given positionally
        args.prompt = args.prompt_text

    from pdserve_common import logs
    from pdserve_worker.model.engine import FirstDraw, Generator, StepOutput, colocated_cache, prefill_first_token
    from pdserve_worker.model.loading.loader import load_model
    from pdserve_worker.model.sampling.sampler import stop_token_ids

    logs.setup("generate")
    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    try:
        params = _sampling(args)
    except ValueError as exc:
        print(f"pdserve generate: invalid sampling options: {exc}", file=sys.stderr)
        return 2
    dtype = resolve_dtype(args.dtype, args.device)
    try:
        loaded = load_model(args.model, dtype=dtype, device=args.device, weights=args.weights)
    except (FileNotFoundError, ValueError, RuntimeError) as exc:
        print(f"pdserve generate: cannot load the model: {exc}", file=sys.stderr)
        return 2
    tok = loaded.tokenizer
    prompt_ids = _encode(tok, args)
    max_len = min(loaded.config.max_position_embeddings, len(prompt_ids) + args.max_tokens + 1)
    generator = Generator(loaded.model, tok, colocated_cache(loaded.model, 1, max_len))
    reason = None

    def show(out: StepOutput) -> None:
        nonlocal reason
        if out.text:
            sys.stdout.write(out.text)
            sys.stdout.flush()
        reason = out.finish_reason or reason

    started = time.perf_counter()
    try:
        prompt_ids = generator.check_prompt(prompt_ids)
    except ValueError as exc:
        print(f"pdserve generate: {exc}", file=sys.stderr)
        return 2
    stops = tuple(stop_token_ids(params, loaded.tokenizer.eos_token_ids))
    first = prefill_first_token(loaded.model, generator.cache, 0, prompt_ids, params, FirstDraw(stop_ids=stops))
    prefill_s = time.perf_counter() - started
    show(generator.add_prefilled(prompt_ids, 0, first, params)[1])
    for out in generator.stream():
        show(out)
    sys.stdout.write("\n")
    sys.stdout.flush()
    stats = generator.stats
    speed = {
        "prefill_tokens_per_s": round(len(prompt_ids) / prefill_s, 1) if prefill_s else 0.0,
        "decode_tokens": stats.decode_tokens,
        "decode_ms_per_token": round(stats.decode_ms_per_step, 2),
    }
    what = {"model": loaded.name, "dtype": dtype, "weights": args.weights, "prompt_tokens": len(prompt_ids)}
    print(logs.kv(**what, **speed, finish_reason=reason), file=sys.stderr)
    return 0


def _sampling(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=tuple(args.stop),
    )


def _encode(tok: Any, args: argparse.Namespace) -> list[int]:
    """The prompt's token ids: as text, or as the user's turn in the model's chat template."""
    if not args.chat:
        return list(tok.encode(args.prompt))
    system = [{"role": "system", "content": args.system}] if args.system else []
    return list(tok.encode_chat([*system, {"role": "user", "content": args.prompt}]))
