"""Engine speed against HF transformers, llama.cpp and the memory roofline, in one run.

Prints prefill tokens/s (128, 512, 2048 tokens), decode ms/token at batch 1, 8, 16 (and the
aggregate tokens/s), the same for HF transformers on the same weights, the ratios, and the
batch-1 roofline fraction: bytes of weights and KV read per token / ms per token, divided by
a memcpy bandwidth measured in this run. All figures are medians over repeats.

With llama-cpp-python installed (`pip install 'pdserve[bench]'`, compiled from source, about
7.5 minutes on 2 cores: a benchmark extra, never a test dependency), also llama.cpp on the same
GGUF file and thread count: batch-1 decode, 16 parallel sequences (one `llama_decode` of 16
tokens per step, one sequence id each) and a 128-token prefill, against ours with `--weights`
(default auto: the GGUF's blocks kept quantized); with `--pairs N` then batch-1 decode of each
back to back N times, the order alternating (a shared machine's ratio). And packed prefill: 8
prompts of 128 tokens in one pass (`prefill_batch`, one row of all tokens; and one prompt per batch row,
`run_layers` on [8, 128]) against one prompt at a time.

    python benchmarks/engine.py            # default model, dtype as `pdserve local` picks it
    python benchmarks/engine.py --quick    # fewer repeats, no 2048-token prefill
    python benchmarks/engine.py --quick --no-hf --weights dequantized   # today's dense route

`--dtype auto` (the default) is what `pdserve local --dtype auto` serves with: bf16 where the
CPU multiplies it natively, else fp32 (torch emulates bf16 GEMM on AVX2-only CPUs, which would
benchmark the emulation rather than the engine).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for folder in ("worker", "operator", "common", "proto"):
    sys.path.insert(0, str(ROOT / folder))

import torch  # noqa: E402

from pdserve_worker.cli.local_deployment import auto_dtype  # noqa: E402
from pdserve_worker.kv.cache import KVCache  # noqa: E402
from pdserve_worker.model.layers.matmul import BlockMatrix, Int4Matrix  # noqa: E402
from pdserve_worker.model.loading.loader import gguf_source, load_model, model_folder  # noqa: E402


def median_seconds(fn, repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def cpu_idle_fraction(seconds: float = 2.0) -> float | None:
    """Share of CPU time idle over `seconds` (Linux /proc/stat): other work skews every figure."""

    def sample() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return fields[3] + fields[4], sum(fields)

    try:
        idle1, total1 = sample()
        time.sleep(seconds)
        idle2, total2 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return (idle2 - idle1) / max(1, total2 - total1)


def wait_for_idle(max_seconds: float, threshold: float = 0.9) -> float | None:
    """Wait (up to `max_seconds`) until the machine is idle enough to measure; returns the idle share seen."""
    deadline = time.monotonic() + max_seconds
    while True:
        idle = cpu_idle_fraction()
        if idle is None or idle >= threshold or time.monotonic() >= deadline:
            return idle
        print(f"machine busy (idle {idle:.0%}), waiting...", file=sys.stderr, flush=True)


def memcpy_gb_per_s(repeats: int) -> float:
    """Bytes copied per second by one large tensor copy (well beyond the caches)."""
    src = torch.ones(256 << 20, dtype=torch.uint8)
    dst = torch.zeros_like(src)
    return src.numel() / median_seconds(lambda: dst.copy_(src), repeats) / 1e9


def prompt_ids(length: int, vocab: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (length,), generator=gen).tolist()


# ---- ours -------------------------------------------------------------------------------------


def ours_prefill(model, dtype: str, length: int, repeats: int) -> float:
    cache = KVCache.allocate(model.config.kv_layout(1, length, dtype))
    ids = prompt_ids(length, model.config.vocab_size, length)
    return length / median_seconds(lambda: model.prefill(ids, cache, 0), repeats, warmup=2)


def ours_decode(model, dtype: str, batch: int, context: int, steps: int) -> float:
    """Median seconds per decode step of `batch` requests whose prompts hold `context` tokens."""
    cache = KVCache.allocate(model.config.kv_layout(batch, context + steps + 3, dtype))
    slots, positions, tokens = list(range(batch)), [], []
    for slot in slots:
        ids = prompt_ids(context, model.config.vocab_size, slot)
        tokens.append(int(model.prefill(ids, cache, slot).argmax()))
        positions.append(context)
    times = []
    for step in range(steps + 2):
        started = time.perf_counter()
        logits = model.decode_step(cache, slots, positions, tokens)
        tokens = logits.argmax(-1).tolist()
        positions = [p + 1 for p in positions]
        if step >= 2:  # the first steps warm caches and allocators
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def ours_packed_prefill(model, dtype: str, prompts: int, length: int, repeats: int) -> dict[str, float]:
    """Tokens/s of `prompts` prompts of `length` tokens: one at a time, packed in one row
    (`prefill_batch`), and one prompt per batch row (`run_layers` on [prompts, length])."""
    cache = KVCache.allocate(model.config.kv_layout(prompts, length, dtype))
    ids = [prompt_ids(length, model.config.vocab_size, 1000 + i) for i in range(prompts)]
    slots = list(range(prompts))
    total = prompts * length

    def one_at_a_time() -> None:
        for slot, p in zip(slots, ids):
            model.prefill(p, cache, slot)

    def rows() -> None:
        hidden = model.run_layers(model.embed(ids), cache.layout.layer_range, cache, slots, [0] * prompts)
        model.head(hidden[:, -1])

    return {
        "one_at_a_time": total / median_seconds(one_at_a_time, repeats),
        "packed": total / median_seconds(lambda: model.prefill_batch(ids, cache, slots), repeats),
        "rows": total / median_seconds(rows, repeats),
    }


# ---- llama.cpp --------------------------------------------------------------------------------


def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


class LlamaCpp:
    """llama.cpp through llama-cpp-python's low-level API: one context holding `seqs` sequences."""

    def __init__(self, path: Path, threads: int, seqs: int, n_ctx: int) -> None:
        import ctypes

        import llama_cpp as lc

        self.lc = lc
        # llama.cpp logs every graph node at load: keep its callback quiet (and referenced).
        self._quiet = lc.llama_log_callback(lambda level, text, user_data: None)
        lc.llama_log_set(self._quiet, ctypes.c_void_p(0))
        lc.llama_backend_init()
        mparams = lc.llama_model_default_params()
        self.model = lc.llama_model_load_from_file(str(path).encode(), mparams)
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = max(512, seqs)
        cparams.n_ubatch = max(512, seqs)
        cparams.n_seq_max = seqs
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        self.ctx = lc.llama_init_from_model(self.model, cparams)
        self.vocab = lc.llama_n_vocab(lc.llama_model_get_vocab(self.model))
        self.batch = lc.llama_batch_init(max(512, seqs), 0, seqs)

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)

    def clear(self) -> None:
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants logits) entries."""
        b = self.batch
        b.n_tokens = len(entries)
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        if self.lc.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def argmax(self, index: int) -> int:
        import numpy as np

        row = np.ctypeslib.as_array(self.lc.llama_get_logits_ith(self.ctx, index), shape=(self.vocab,))
        return int(row.argmax())


def llama_prefill(ll: LlamaCpp, length: int, repeats: int) -> float:
    ids = prompt_ids(length, ll.vocab, length)

    def run() -> None:
        ll.clear()
        ll.decode([(t, p, 0, p == length - 1) for p, t in enumerate(ids)])

    return length / median_seconds(run, repeats)


def llama_decode(ll: LlamaCpp, batch: int, context: int, steps: int) -> float:
    """Median seconds per step of `batch` sequences (one token each per step, one llama_decode)."""
    ll.clear()
    tokens = []
    for seq in range(batch):
        ids = prompt_ids(context, ll.vocab, seq)
        ll.decode([(t, p, seq, p == context - 1) for p, t in enumerate(ids)])
        tokens.append(ll.argmax(context - 1))
    times = []
    for step in range(steps + 2):
        started = time.perf_counter()
        ll.decode([(tokens[seq], context + step, seq, True) for seq in range(batch)])
        tokens = [ll.argmax(i) for i in range(batch)]
        if step >= 2:
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def paired_batch1(model, ll: LlamaCpp, dtype: str, context: int, steps: int, pairs: int) -> list[float]:
    """ours ÷ llama.cpp batch-1 step time, `pairs` times, the two measured back to back in the
    order alternating: on a shared machine the sequential figures above move 20-30 % between
    runs, a pair's two halves see the same machine."""
    ratios = []
    for i in range(pairs):
        order = ("ours", "llama") if i % 2 == 0 else ("llama", "ours")
        took = {
            who: ours_decode(model, dtype, 1, context, steps) if who == "ours" else llama_decode(ll, 1, context, steps)
            for who in order
        }
        ratios.append(took["ours"] / took["llama"])
        print(
            f"pair {i + 1}/{pairs}: ours {took['ours'] * 1e3:.2f} ms, llama.cpp {took['llama'] * 1e3:.2f} ms, "
            f"ratio {ratios[-1]:.2f}",
            flush=True,
        )
    return ratios


# ---- HF transformers --------------------------------------------------------------------------


def hf_load(folder: Path, dtype: torch.dtype):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
    model.eval()
    return model


def hf_prefill(model, vocab: int, length: int, repeats: int) -> float:
    ids = torch.tensor([prompt_ids(length, vocab, length)])

    def run() -> None:
        with torch.no_grad():
            model(ids, use_cache=True)

    return length / median_seconds(run, repeats)


def hf_decode(model, vocab: int, batch: int, context: int, steps: int) -> float:
    """Median seconds per decode step inside HF `generate` (greedy, fixed length).

    A logits processor stamps the time at every step; the gaps between stamps are the decode
    steps (the first stamp comes after the prefill).
    """
    import transformers

    stamps: list[float] = []

    class Stamp(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            return scores

    ids = torch.tensor([prompt_ids(context, vocab, slot) for slot in range(batch)])
    with torch.no_grad():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=steps + 3,
            min_new_tokens=steps + 3,
            do_sample=False,
            pad_token_id=0,
            logits_processor=transformers.LogitsProcessorList([Stamp()]),
        )
    gaps = [b - a for a, b in zip(stamps, stamps[1:])][2:]  # the first steps warm caches and allocators
    return statistics.median(gaps)


# ---- report -----------------------------------------------------------------------------------


def tensor_bytes(t) -> int:
    return t.nbytes if isinstance(t, (Int4Matrix, BlockMatrix)) else t.numel() * t.element_size()


def weight_bytes(model) -> int:
    """Bytes a decode step reads: every layer's matrices and norms, the final norm, the LM head."""
    total = tensor_bytes(model.norm) + tensor_bytes(model.lm_head)
    for layer in model.layers.values():
        for t in (layer.attn_norm, layer.qkv, layer.o, layer.mlp_norm, layer.gate_up, layer.down):
            total += tensor_bytes(t)
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--context", type=int, default=128, help="prompt tokens before decode")
    parser.add_argument("--steps", type=int, default=24, help="decode steps timed")
    parser.add_argument("--quick", action="store_true", help="3 repeats, no 2048-token prefill, fewer steps")
    parser.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    parser.add_argument("--no-llama", action="store_true", help="skip llama.cpp (skipped anyway if not installed)")
    parser.add_argument(
        "--weights",
        default="auto",
        choices=["auto", "dequantized", "int8", "int4"],
        help="how our matrices are held (default auto: a GGUF's blocks stay quantized)",
    )
    parser.add_argument(
        "--pairs", type=int, default=0, help="then batch-1 decode, ours and llama.cpp back to back, this many times"
    )
    parser.add_argument("--packed-prompts", type=int, default=8, help="prompts of the packed prefill")
    parser.add_argument("--packed-length", type=int, default=128, help="tokens per prompt of the packed prefill")
    parser.add_argument(
        "--wait-idle",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="before each phase, wait up to this long for a quiet machine (shared hosts)",
    )
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.steps = 3, 12
    torch.set_num_threads(args.threads)
    dtype = auto_dtype() if args.dtype == "auto" else args.dtype
    prefill_lengths = [128, 512] if args.quick else [128, 512, 2048]
    batches = [1, 8, 16]

    print(
        f"# engine benchmark  {time.strftime('%Y-%m-%d %H:%M')}  {platform.processor() or platform.machine()}  "
        f"threads={args.threads}  torch={torch.__version__}  dtype={dtype}  weights={args.weights}",
        flush=True,
    )
    idle = wait_for_idle(args.wait_idle)
    print(f"cpu idle before start: {'unknown' if idle is None else f'{idle:.0%}'}", flush=True)
    bandwidth = memcpy_gb_per_s(args.repeats)
    print(f"memcpy bandwidth: {bandwidth:.2f} GB/s", flush=True)

    loaded = load_model(args.model, dtype=dtype, weights=args.weights)
    model = loaded.model
    print(f"routes: {loaded.routes}", flush=True)
    wait_for_idle(args.wait_idle)
    ours_pf = {n: ours_prefill(model, dtype, n, args.repeats) for n in prefill_lengths}
    wait_for_idle(args.wait_idle)
    ours_dec = {b: ours_decode(model, dtype, b, args.context, args.steps) for b in batches}
    for n, v in ours_pf.items():
        print(f"ours prefill {n:>5} tokens: {v:8.1f} tokens/s", flush=True)
    for b, s in ours_dec.items():
        print(f"ours decode batch {b:>2}: {s * 1e3:7.2f} ms/step  {b / s:7.1f} tokens/s", flush=True)
    wait_for_idle(args.wait_idle)
    packed = ours_packed_prefill(model, dtype, args.packed_prompts, args.packed_length, args.repeats)
    for name, v in packed.items():
        print(f"ours prefill {args.packed_prompts} x {args.packed_length} {name}: {v:8.1f} tokens/s", flush=True)

    llama_pf: float | None = None
    llama_dec: dict[int, float] = {}
    paired: list[float] = []
    gguf_path = gguf_source(args.model)
    if args.no_llama or gguf_path is None:
        print("llama.cpp: skipped" + ("" if args.no_llama else " (the model is not a GGUF file)"), flush=True)
    elif not llama_cpp_available():
        print("llama.cpp: skipped (pip install 'pdserve[bench]' builds llama-cpp-python)", flush=True)
    else:
        ll = LlamaCpp(gguf_path, args.threads, max(batches), max(batches) * (args.context + args.steps + 8))
        try:
            wait_for_idle(args.wait_idle)
            llama_pf = llama_prefill(ll, 128, args.repeats)
            wait_for_idle(args.wait_idle)
            llama_dec = {b: llama_decode(ll, b, args.context, args.steps) for b in (1, max(batches))}
            paired = paired_batch1(model, ll, dtype, args.context, args.steps, args.pairs)
        finally:
            ll.close()
        print(f"llama.cpp prefill   128 tokens: {llama_pf:8.1f} tokens/s", flush=True)
        for b, s in llama_dec.items():
            print(f"llama.cpp decode batch {b:>2}: {s * 1e3:7.2f} ms/step  {b / s:7.1f} tokens/s", flush=True)

    hf_pf: dict[int, float] = {}
    hf_dec: dict[int, float] = {}
    if not args.no_hf:
        folder, _ = model_folder(args.model, dtype)
        hf = hf_load(folder, getattr(torch, dtype))
        vocab = loaded.config.vocab_size
        hf_repeats = max(1, args.repeats // 2)
        wait_for_idle(args.wait_idle)
        hf_pf = {n: hf_prefill(hf, vocab, n, hf_repeats if n < 2048 else 1) for n in prefill_lengths}
        wait_for_idle(args.wait_idle)
        # HF's batched bf16 steps take seconds on CPUs without bf16 GEMM: fewer of them, still a median.
        hf_dec = {
            b: hf_decode(hf, vocab, b, args.context, args.steps if b == 1 else min(args.steps, 8)) for b in batches
        }
        for n, v in hf_pf.items():
            print(f"hf   prefill {n:>5} tokens: {v:8.1f} tokens/s", flush=True)
        for b, s in hf_dec.items():
            print(f"hf   decode batch {b:>2}: {s * 1e3:7.2f} ms/step  {b / s:7.1f} tokens/s", flush=True)

    kv_bytes = (
        2
        * loaded.config.num_layers
        * (args.context + args.steps // 2)
        * loaded.config.num_kv_heads
        * loaded.config.head_dim
        * model.embed_tokens.element_size()
    )
    per_token = weight_bytes(model) + kv_bytes
    achieved = per_token / ours_dec[1] / 1e9
    print("\n## summary")
    print("| metric | ours | HF | ours/HF |\n|---|---|---|---|")
    for n in prefill_lengths:
        hf_v = hf_pf.get(n)
        print(
            f"| prefill {n} (tokens/s) | {ours_pf[n]:.0f} | {hf_v or float('nan'):.0f} | "
            f"{ours_pf[n] / hf_v if hf_v else float('nan'):.2f} |"
        )
    for b in batches:
        hf_s = hf_dec.get(b)
        print(
            f"| decode batch {b} (ms/step) | {ours_dec[b] * 1e3:.1f} | {hf_s * 1e3 if hf_s else float('nan'):.1f} | "
            f"{ours_dec[b] / hf_s if hf_s else float('nan'):.2f} |"
        )
    print(
        f"\nbatch-1 decode: {per_token / 1e6:.0f} MB read per token -> {achieved:.2f} GB/s = "
        f"{achieved / bandwidth:.2f} of memcpy ({bandwidth:.2f} GB/s)"
    )
    print(
        f"aggregate tokens/s batch 16 / batch 1: {(16 / ours_dec[16]) / (1 / ours_dec[1]):.2f}x; "
        f"batch 8 / batch 1: {(8 / ours_dec[8]) / (1 / ours_dec[1]):.2f}x"
    )
    if hf_dec:
        print(f"batch-1 decode speed ours vs HF: {hf_dec[1] / ours_dec[1]:.2f}x faster")
    one = packed["one_at_a_time"]
    print(
        f"packed prefill {args.packed_prompts} x {args.packed_length}: one row {packed['packed'] / one:.2f}x, "
        f"one prompt per row {packed['rows'] / one:.2f}x the one-at-a-time tokens/s (target >= 2x)"
    )
    if llama_dec:
        top = max(batches)
        print(
            f"batch-1 decode ours / llama.cpp: {ours_dec[1] / llama_dec[1]:.2f} (target <= 1.5); "
            f"batch-{top} aggregate tokens/s ours / llama.cpp: {llama_dec[top] / ours_dec[top]:.2f} (target >= 1); "
            f"prefill 128 ours / llama.cpp: {ours_pf[128] / llama_pf:.2f}"
        )
    if paired:
        print(
            f"batch-1 decode ours / llama.cpp, {len(paired)} back-to-back pairs: median {statistics.median(paired):.2f} "
            f"[{min(paired):.2f} - {max(paired):.2f}]"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
