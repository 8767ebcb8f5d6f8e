"""What a request's logits processors and logprobs cost against the decode step they ride on (issue #31).

Run:    .venv/bin/python benchmarks/processors.py [--batch 16] [--steps 20]

The bundled model (the dtype `pdserve local` picks here) decodes a batch of `--batch` requests
of 256 prompt tokens in one process (Generator, as a decode worker runs it); the same steps
are timed with plain greedy requests and with every request asking for all the processors
(presence 0.5, frequency 0.5, repetition 1.2, 20 logit biases, min_tokens 8, min_p 0.05), and
with every request asking for logprobs with 5 and with 20 alternatives (the most the API allows).
Prints the median step time of each and its ratio to plain; the targets are <= 1.05.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve  # noqa: E402,F401  (puts worker/ and the rest on sys.path)
from seed_transfer import machine  # noqa: E402


def step_times(loaded, params, batch: int, steps: int) -> list[float]:
    import torch

    from pdserve_worker.model.engine import Generator, colocated_cache, prefill_first_token

    cache = colocated_cache(loaded.model, batch, 512)
    gen = Generator(loaded.model, loaded.tokenizer, cache)
    with torch.inference_mode():
        for slot in range(batch):
            prompt = [(slot * 131 + i * 17) % 20000 + 10 for i in range(256)]
            first = prefill_first_token(loaded.model, cache, slot, prompt, params)
            gen.add_prefilled(prompt, slot, first, params)
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            gen.step()
            times.append(time.perf_counter() - started)
    return times[2:]  # the first steps warm the allocator


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    from pdserve_worker.cli.local_deployment import auto_dtype
    from pdserve_worker.model.loading.default_model import default_model_path
    from pdserve_worker.model.loading.loader import load_model
    from pdserve_worker.model.sampling.params import SamplingParams

    dtype = auto_dtype()
    loaded = load_model(str(default_model_path()), dtype=dtype)
    plain = SamplingParams(max_tokens=args.steps + 4, temperature=0, ignore_eos=True)
    processed = plain.model_copy(
        update={
            "presence_penalty": 0.5,
            "frequency_penalty": 0.5,
            "repetition_penalty": 1.2,
            "logit_bias": tuple((100 + i, 1.0) for i in range(20)),
            "min_tokens": 8,
            "min_p": 0.05,
        }
    )
    variants = {
        "plain": plain,
        "processed": processed,
        "logprobs 5": plain.model_copy(update={"logprobs": 5}),
        "logprobs 20": plain.model_copy(update={"logprobs": 20}),
    }
    print(f"# processors and logprobs on {machine()}, SmolLM2-135M {dtype}, batch {args.batch}", flush=True)
    rounds: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(3):  # alternate, on a shared host
        for name, params in variants.items():
            rounds[name] += step_times(loaded, params, args.batch, args.steps)
            print(f"  round {r + 1}: {name} step p50 {statistics.median(rounds[name]) * 1e3:.1f} ms", flush=True)
    base = statistics.median(rounds["plain"])
    print(f"decode step p50: plain {base * 1e3:.1f} ms")
    for name in list(variants)[1:]:
        value = statistics.median(rounds[name])
        print(f"  {name}: {value * 1e3:.1f} ms, ratio {value / base:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
