"""The model's native CPU ops: decode attention over block tables, causal prefill attention in bf16,
the elementwise parts of a layer (RMSNorm with its residual add, rotary embedding of q and k,
SiLU(gate) * up) and the fp32 decode products on AVX2 (csrc/dense_linear.cpp).

Why ops of ours: decode attention runs each row over exactly its own keys in one call (SDPA takes
one key length per call: padded rows change a row's last bits, issue #17; a call per row is
slow); a layer's ~35 elementwise torch ops each cost a dispatch and a pass over memory; prefill
attention keeps each score tile in registers on AVX512-BF16 (else SDPA serves). Measurements:
benchmarks/README.md, "`model/layers/native.py`".

`csrc/*.cpp` are ATen, compiled once per machine by torch's extension builder (g++ and ninja at
first use, then a cached library per source hash, torch version and CPU flags under the pdserve
cache). Where it cannot be built or `PDSERVE_NATIVE_OPS=torch`, the torch ops run; both are batch
invariant and agree within rounding (tests/unit/test_native_ops.py, test_prefill_attention.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve_common.logs import kv

log = logging.getLogger(__name__)

SOURCES = tuple(
    Path(__file__).with_name("csrc") / name
    for name in (
        "decode_attention.cpp",
        "dense_gemm.cpp",
        "dense_linear.cpp",
        "layer_ops.cpp",
        "prefill_attention.cpp",
        "prefill_attention_fp32.cpp",
        "quant_linear.cpp",
    )
)
HEADERS = tuple(  # included by the sources: in the digest too
    Path(__file__).with_name("csrc") / name for name in ("avx2_ops.h", "cpu_features.h", "rows.h")
)
ENV = "PDSERVE_NATIVE_OPS"  # kernel (default) | torch

_lock = threading.Lock()
_state: dict[str, object] = {}


def _cache_root() -> Path:
    base = os.environ.get("PDSERVE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "pdserve")
    return Path(base) / "kernels"


def _isa() -> tuple[str, list[str], list[str]]:
    """(name, compiler flags, macros) of the widest vector ISA torch itself uses on this CPU, as
    inductor picks it (ATen's Vectorized follows the CPU_CAPABILITY_* macro it is built with).

    Inductor's module imports dynamo, seconds of CPU in every process that loads a model
    (benchmarks/README.md, "Model measurements behind the module docstrings"). So the pick is kept in the pdserve cache under a key of the CPU's flags
    and torch's version, and a later process on the same CPU and torch reads it back. (The record
    names compiler flags, passed as a list, never through a shell; it is as trusted as the built
    libraries beside it: whoever can write one can write the other.)"""
    key = _cpu_key()
    cached = _cache_root() / f"isa-{key}.json" if key else None
    if cached is not None:
        try:
            known = json.loads(cached.read_text())
            return str(known["name"]), [str(f) for f in known["flags"]], [str(m) for m in known["macros"]]
        except (OSError, ValueError, KeyError, TypeError):
            pass  # not picked yet on this CPU, or unreadable: pick it again below
    picked = _pick_isa()
    if cached is not None:
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            scratch = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")
            scratch.write_text(json.dumps({"name": picked[0], "flags": picked[1], "macros": picked[2]}))
            scratch.replace(cached)  # (atomic: a reader sees the whole file or none)
        except OSError as exc:  # a read-only cache: pick again next time
            log.info(kv(event="native_isa_not_cached", path=str(cached), error=repr(exc)[:200]))
    return picked


def _pick_isa() -> tuple[str, list[str], list[str]]:
    from torch._inductor import cpu_vec_isa

    isa = cpu_vec_isa.pick_vec_isa()
    if not isa:
        return "default", [], []
    flags = isa.build_arch_flags().split()
    return str(isa), flags, [f"-D{m}" for m in isa.build_macro()]


def _cpu_key() -> str | None:
    """A digest of what the CPU reports of its features (/proc/cpuinfo's flags or Features line),
    torch's version and ATEN_CPU_CAPABILITY, or None where the CPU does not say (then the ISA is
    picked every time)."""
    try:
        with open("/proc/cpuinfo") as info:
            line = next((ln for ln in info if ln.startswith(("flags", "Features"))), None)
    except OSError:
        return None
    if line is None:
        return None
    # torch's and inductor's own override (tests force AVX2 with it): a forced build is its own.
    forced = os.environ.get("ATEN_CPU_CAPABILITY", "")
    return hashlib.sha256(f"{torch.__version__}\n{line.strip()}\n{forced}".encode()).hexdigest()[:16]


# -fopenmp: at::parallel_for is inline OpenMP, so without it every op ran on one thread (the
# library then shares the libgomp torch already loaded: same soname, same pool, same
# torch.set_num_threads).
CFLAGS = ("-O3", "-fno-math-errno", "-fopenmp")


@dataclass(frozen=True)
class _Library:
    isa: str
    flags: list[str]
    name: str
    folder: Path

    @property
    def path(self) -> Path:
        return self.folder / f"{self.name}.so"

    @property
    def built(self) -> bool:
        """Built before (the name holds the sources, torch and flags) and not being built now."""
        return self.path.is_file() and not (self.folder / "lock").exists()


def _library() -> _Library:
    isa, arch, macros = _isa()
    flags = [*CFLAGS, *arch, *macros]
    digest = _digest(flags)
    return _Library(isa, flags, f"pdserve_native_{digest}", _cache_root() / f"native-{digest}")


# How long a first build takes (g++ over the sources, one job per core), as `pdserve local` says
# before it starts one (measured builds: benchmarks/README.md, "Model measurements behind the
# module docstrings").
BUILD_ESTIMATE = "usually 20-60 s on 2 cores"


def prepare(say: Callable[[str], None]) -> None:
    """Build the kernels now, in a launcher, before its workers start: each worker would
    otherwise wait silently on the one building them (a first `pdserve local --demo` sat 57 s
    at "ready members 0/1" saying nothing). Says what it does and how long it usually takes;
    a build that fails is said too (the workers then run torch's ops)."""
    if os.environ.get(ENV, "kernel") == "torch":
        return
    lib = _library()
    if lib.built:
        say(f"native kernels for {lib.isa}: built before ({lib.folder})")
        return
    say(f"compiling native kernels for {lib.isa}, once per machine and torch version, {BUILD_ESTIMATE} ({lib.folder})")
    started = time.monotonic()
    try:
        build()
    except Exception as exc:  # noqa: BLE001 - said, and the workers run torch's ops
        say(f"native kernels not built ({repr(exc)[:200]}): the workers run torch's ops")
        return
    say(f"native kernels built in {time.monotonic() - started:.0f}s")


def describe() -> dict[str, object]:
    """What `pdserve info` prints: the ISA the kernels are built for, whether they are built on
    this machine, and the path each op takes here (loading the library if it is built; never
    compiling it)."""
    lib = _library()
    out: dict[str, object] = {"isa": lib.isa, "built": lib.built, "cache": str(lib.folder)}
    if os.environ.get(ENV, "kernel") == "torch":
        out["paths"] = f"torch's ops ({ENV}=torch)"
        return out
    if not lib.built:
        out["paths"] = "not known until built: the first model load builds them (pdserve local, before its workers)"
        return out
    if not available():
        out["paths"] = "torch's ops (the library did not load: the worker's log says why)"
        return out
    vectors = f"Vectorized<float> on {lib.isa}"
    quant = "native block kernel, AVX2 FMA/F16C" + (
        ", int8 inputs on AVX2 vpmaddubsw" if quant_inputs() == "int8" else ", fp32 inputs"
    )
    out["paths"] = {
        "decode_attention": f"native, {vectors}",
        "layer_ops": f"native (RMSNorm, rotary, SiLU), {vectors}",
        "prefill_attention_bf16": "native AVX512-BF16 (vdpbf16ps)" if _bf16_dot() else "torch SDPA",
        "prefill_attention_fp32": "native AVX2 FMA" if _fp32_attention() else "torch SDPA",
        "dense_fp32_matmul": "native AVX2 FMA (dense_linear, dense_gemm)" if dense_serves() else "oneDNN",
        "quantized_matmul": quant if quant_serves() else "torch _weight_int4pack_mm_for_cpu",
    }
    return out


def build(verbose: bool = False) -> str:
    """Load the cached library, or compile it first, and register the `torch.ops.pdserve` ops;
    returns the ISA it was built for."""
    lib = _library()
    isa, flags, name, folder, library = lib.isa, lib.flags, lib.name, lib.folder, lib.path
    # Built before: load the library directly; torch's loader would run ninja first (seconds).
    if lib.built:
        torch.ops.load_library(str(library))
        return isa
    from torch.utils import cpp_extension  # (0.3 s of imports: only where it compiles)

    folder.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name=name,
        sources=[str(path) for path in SOURCES],
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        build_directory=str(folder),
        is_python_module=False,
        verbose=verbose,
    )
    return isa


def _digest(flags: list[str]) -> str:
    """What the library is built from: every source and header, torch's version, the flags."""
    text = b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    return hashlib.sha256(text + torch.__version__.encode() + " ".join(flags).encode()).hexdigest()[:16]


def available() -> bool:
    """Whether the native ops are there (built or loaded now on the first call, once per process)."""
    known = _state.get("ok")
    if known is not None:  # (asked once per layer of every step: no lock once settled)
        return bool(known)
    with _lock:
        if "ok" not in _state:
            _state["ok"] = _load()
        return bool(_state["ok"])


def _load() -> bool:
    choice = os.environ.get(ENV, "kernel")
    if choice == "torch":
        log.info(kv(event="native_ops", impl="torch", why=f"{ENV}=torch"))
        return False
    if choice != "kernel":
        raise ValueError(f"{ENV} must be 'kernel' or 'torch', got {choice!r}")
    try:
        isa = build()
    except Exception as exc:  # no compiler, no ninja, a read-only cache: the torch path serves
        log.warning(kv(event="native_ops", impl="torch", why="native ops not built", error=repr(exc)[:300]))
        return False
    log.info(kv(event="native_ops", impl="kernel", isa=isa))
    return True


def decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of q `[B, heads, head_dim]` over each row's keys: row b's key j is
    `keys[tables[b, j // B], j % B]` of keys/values `[blocks, B, kv_heads, head_dim]` (a block
    dense, blocks at any stride), for j < lengths[b]. Returns `[B, heads, head_dim]`."""
    return torch.ops.pdserve.decode_attention(q, keys, values, tables, lengths, scale)


# head_dim a multiple of the widest Vectorized<float> (AVX512: 16 floats) on every ISA we build for.
HEAD_DIM_MULTIPLE = 16


@dataclass(frozen=True)
class DecodeRows:
    """What the kernel needs of one decode step, shared by every layer: each row's block table
    (a slot pool is one block of max_len tokens per slot) and key count."""

    tables: torch.Tensor  # [B, max_blocks] int64
    lengths: torch.Tensor  # [B] int64
    block_tokens: int = 0  # > 0: the pools come as flat token rows, viewed in blocks of this many

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """q `[B, 1, heads, head_dim]` over pools `[blocks, block_tokens, kv_heads, head_dim]` (or
        flat `[rows, kv_heads, head_dim]` with `block_tokens` set): `[B, 1, heads * head_dim]`."""
        batch, _, heads, head_dim = q.shape
        if self.block_tokens:
            keys = keys.view(-1, self.block_tokens, *keys.shape[1:])
            values = values.view(-1, self.block_tokens, *values.shape[1:])
        query = q.reshape(batch, heads, head_dim).contiguous()
        out = decode_attention(query, keys, values, self.tables, self.lengths, head_dim**-0.5)
        return out.view(batch, 1, heads * head_dim)


def rows_for(
    tables: Sequence[Sequence[int]], lengths: Sequence[int], head_dim: int, device: torch.device, block_tokens: int = 0
) -> DecodeRows | None:
    """The kernel's view of a decode step, or None where it does not serve (not built, not a CPU
    pool, or a head_dim it does not take): the caller then attends row by row with SDPA."""
    if device.type != "cpu" or head_dim % HEAD_DIM_MULTIPLE or not available():
        return None
    width = max(len(t) for t in tables)
    padded = torch.tensor([[*t, *([0] * (width - len(t)))] for t in tables], dtype=torch.long)
    return DecodeRows(padded, torch.tensor(list(lengths), dtype=torch.long), block_tokens)


PREFILL_HEAD_DIMS = (32, 64, 128)  # the prefill kernel's register tilings (csrc/prefill_attention.cpp)


def prefill_serves(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether a causal prefill kernel takes q `[n, heads, head_dim]` over keys `[T, kv_heads,
    head_dim]` (heads and head_dim dense, one dtype): bf16 on a CPU with AVX512-BF16 and a
    head_dim it tiles (csrc/prefill_attention.cpp); fp32 or bf16 on an AVX2 build, head_dim a
    multiple of 8 up to 128 (csrc/prefill_attention_fp32.cpp). Elsewhere the caller runs torch's
    SDPA (fp16, fp32 on AVX512 CPUs, other devices)."""
    head_dim = q.shape[-1]
    if not (
        q.device.type == "cpu"
        and q.dtype == keys.dtype == values.dtype
        and q.stride(-1) == 1
        and keys.stride(-1) == 1
        and keys.stride(-2) == head_dim
        and keys.stride() == values.stride()
        and available()
    ):
        return False
    if _bf16_kernel(q):
        return True
    return q.dtype in (torch.float32, torch.bfloat16) and head_dim % 8 == 0 and head_dim <= 128 and _fp32_attention()


def _bf16_kernel(q: torch.Tensor) -> bool:
    return q.dtype == torch.bfloat16 and q.shape[-1] in PREFILL_HEAD_DIMS and _bf16_dot()


def _bf16_dot() -> bool:
    known = _state.get("bf16_dot")
    if known is None:
        known = _state["bf16_dot"] = bool(torch.ops.pdserve.prefill_attention_supported())
    return bool(known)


def _fp32_attention() -> bool:
    known = _state.get("fp32_attention")
    if known is None:
        known = _state["fp32_attention"] = bool(torch.ops.pdserve.prefill_attention_fp32_supported())
    return bool(known)


def quant_serves() -> bool:
    """Whether the block-quantized matrix kernel runs here: the native ops built, on an x86 CPU
    with AVX2, FMA and F16C. Elsewhere quantized weights take torch's int4 kernel (matmul.pack_int4)."""
    if not available():
        return False
    known = _state.get("quant")
    if known is None:
        known = _state["quant"] = bool(torch.ops.pdserve.quant_linear_supported())
    return bool(known)


def dense_serves() -> bool:
    """Whether fp32 products run on the native kernels (csrc/dense_linear.cpp for a decode step's
    rows, csrc/dense_gemm.cpp for prefill chunks: both need AVX2 and FMA only): the
    native ops built, on an x86 CPU whose widest vectors torch uses are AVX2 (where it was
    measured against oneDNN; on AVX512 CPUs oneDNN's own kernels are twice as wide and keep them)."""
    if not available():
        return False
    known = _state.get("dense")
    if known is None:
        capability = torch.backends.cpu.get_cpu_capability()
        known = _state["dense"] = capability == "AVX2" and bool(torch.ops.pdserve.dense_linear_supported())
    return bool(known)


def dense_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x `[..., k]` times fp32 w `[n, k]` (+ bias `[n]`), both contiguous, k a multiple of 8:
    `[..., n]` fp32, each output's bits independent of the other rows (csrc/dense_linear.cpp)."""
    return torch.ops.pdserve.dense_linear(x, w, bias)


def dense_gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The same product for inputs of many rows (prefill chunks), on the register tile of BLAS
    libraries (csrc/dense_gemm.cpp): each output's bits independent of the other rows, but not
    `dense_linear`'s bits."""
    return torch.ops.pdserve.dense_gemm(x, w, bias)


QUANT_INPUTS_ENV = "PDSERVE_QUANT_INPUTS"  # fp32 (default) | int8: the block kernel's inputs to 4-bit weights


def quant_inputs() -> str:
    """How the block kernel takes the input to a 4-bit weight: "fp32" (exact, the default) or
    "int8" (quantized per block of 32 as llama.cpp does, integer dot products: faster, but its
    logits leave the file's model; figures in benchmarks/README.md, "Opt-in int8 inputs to 4-bit
    weights"). Opt-in: the default stays the file's model, as HF transformers computes it."""
    choice = os.environ.get(QUANT_INPUTS_ENV, "fp32")
    if choice not in ("int8", "fp32"):
        raise ValueError(f"{QUANT_INPUTS_ENV} must be 'int8' or 'fp32', got {choice!r}")
    return choice


def quant_linear(
    x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, n: int, wide: bool, out_bf16: bool, int8_inputs: bool
):
    """x `[..., k]` (fp32, contiguous) times a weight of `n` rows in matmul.pack_native's layout:
    `[..., n]` in bf16 or fp32 (csrc/quant_linear.cpp). `int8_inputs` (4-bit weights only): x
    quantized per block of 32 to 8 bits, the dot products in integers."""
    return torch.ops.pdserve.quant_linear(x, values, scales, n, wide, out_bf16, int8_inputs)


def causal_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Attention of q `[n, heads, head_dim]`, the last n of T positions, over keys/values `[T,
    kv_heads, head_dim]` (query p sees keys j <= T - n + p): `[n, heads * head_dim]`. A query's
    bits depend only on its own keys, so a prompt prefilled whole or in chunks gets the same."""
    n, heads, head_dim = q.shape
    kernel = torch.ops.pdserve.prefill_attention if _bf16_kernel(q) else torch.ops.pdserve.prefill_attention_fp32
    out = kernel(q, keys, values, head_dim**-0.5)
    return out.view(n, heads * head_dim)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm of the rows of x `[..., width]` (fp32 inside, the weight in x's dtype). The
    ops take any leading shape as rows and keep it (csrc/rows.h says why)."""
    return torch.ops.pdserve.rms_norm(x.contiguous(), weight, eps)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, its RMSNorm): a sublayer's residual add and the next sublayer's norm."""
    if delta.shape != x.shape:
        delta = delta.reshape(x.shape)
    return torch.ops.pdserve.add_rms_norm(x.contiguous(), delta.contiguous(), weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of `[..., 2 * inter]` (gate first): `[..., inter]`."""
    return torch.ops.pdserve.silu_mul(gate_up.contiguous())


def rope_qkv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: int,
    kv_heads: int,
    qk_norm: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v `[B, T, heads|kv_heads, head_dim]` of qkv `[B, T, width]`, q and k rotated by
    cos/signed sin `[B, T, 1, head_dim]` (rope.cos_sin's), after qwen3's per-head norm when
    `qk_norm` `[heads + kv_heads, head_dim]` is given."""
    return torch.ops.pdserve.rope_qkv(
        qkv.contiguous(), cos.contiguous(), sin.contiguous(), heads, kv_heads, qk_norm, eps
    )
