// x @ W.T (+ bias) for an fp32 or bf16 weight W [n, k] as the model holds it (row-major, no
// repacking), for the few fp32 input rows of a decode step (up to matmul.DENSE_KERNEL_MAX_ROWS),
// in fp32 FMA on AVX2. A bf16 weight is widened to fp32 in registers (exact: a bf16 is the top
// half of an fp32), so it gives the bits of the same values held in fp32 while reading half the
// bytes: bf16 models on CPUs without native bf16 (matmul.Linear).
//
// Why a kernel: a decode step's products are a string of small-M GEMMs whose weights come from
// DRAM once per step. oneDNN's fp32 kernels (prepacked for 128 rows, matmul.REORDER_ROWS) read
// them at ~23 GB/s at one row where this 2-vCPU Zen 3 streams ~31 GB/s, and at 8-16 rows they
// do not overlap the weight stream with the multiplies: measured 2026-12-05, 30 layers of
// SmolLM2-135M's shapes plus its head, ms: 23 / 34 / 49 at 1 / 8 / 16 rows against this kernel's
// 21 / 23 / 37 (benchmarks/dense_kernel.py; benchmarks/README.md). Longer inputs (prefill chunks)
// are compute bound: matmul.Linear sends them to dense_gemm.cpp's register tile on the same
// weight (and the longest to torch's GEMM).
//
// The tile: 4 input rows by 3 weight rows, 12 accumulators of 8 lanes along k (16 registers:
// 3 weight vectors, 1 input vector), each output's sum in lanes over k in order, then the lanes
// added in a fixed tree. So an output's bits depend only on its own input row and weight row,
// never on how many rows came with it (batch invariance, as the other native ops). Threads take
// contiguous ranges of weight rows (one stream each); while a group of 3 weight rows is
// multiplied, the next group is prefetched a few cache lines per step, spread over the group's
// tiles, so DRAM keeps streaming while the FMA ports work. Inputs of more rows than fit in L2
// (X_BYTES) pass over the weights in chunks of that many: each chunk's rows stay in cache.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "avx2_ops.h"
#include "cpu_features.h"
#include "rows.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t LANES = 8;  // floats per AVX2 vector: k must be a multiple
constexpr int ROWS = 4;       // input rows per tile
constexpr int COLS = 3;       // weight rows (outputs) per tile
constexpr int64_t LINE = 64;  // bytes per cache line
constexpr int64_t X_BYTES = 384 * 1024;  // input rows per pass over the weights: they stay in L2

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma")

using pdserve_avx2::lane_sum;
using pdserve_avx2::load8;

// The next weight group's bytes [at, end), requested `per_step` lines per step of 8 inputs.
struct Prefetch {
  const char* at;
  const char* end;
  int64_t per_step;
};

// Input rows x[0..R) times weight rows w[0..C), each k long: out[r * ldo + c] (+ bias[c]).
template <int R, int C, typename W>
void tile(const float* x, const W* w, int64_t k, const float* bias, float* out, int64_t ldo, Prefetch& pf) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t j = 0; j < k; j += LANES) {
    for (int64_t p = 0; p < pf.per_step && pf.at < pf.end; ++p, pf.at += LINE) _mm_prefetch(pf.at, _MM_HINT_T0);
    __m256 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = load8(w + c * k + j);  // (a bf16 weight widened: avx2_ops.h)
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * k + j);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r * ldo + c] = lane_sum(acc[r][c]) + (bias != nullptr ? bias[c] : 0.0f);
}

// Every input row times weight rows w[0..C): tiles of 4 rows, then the remainder.
template <int C, typename W>
void weight_group(const float* x, int64_t rows, const W* w, int64_t k, const float* bias, float* out, int64_t n,
                  const char* next, const char* next_end) {
  const int64_t tiles = (rows + ROWS - 1) / ROWS, steps = k / LANES;
  const int64_t lines = next_end > next ? (next_end - next + LINE - 1) / LINE : 0;
  Prefetch pf{next, next_end, (lines + tiles * steps - 1) / (tiles * steps)};
  int64_t r = 0;
  for (; r + ROWS <= rows; r += ROWS) tile<ROWS, C, W>(x + r * k, w, k, bias, out + r * n, n, pf);
  if (rows - r == 3) tile<3, C, W>(x + r * k, w, k, bias, out + r * n, n, pf);
  if (rows - r == 2) tile<2, C, W>(x + r * k, w, k, bias, out + r * n, n, pf);
  if (rows - r == 1) tile<1, C, W>(x + r * k, w, k, bias, out + r * n, n, pf);
}

template <typename W>
void run(const float* x, int64_t rows, const W* w, int64_t n, int64_t k, const float* bias, float* out) {
  const int64_t chunk = std::max<int64_t>(ROWS, X_BYTES / (k * int64_t(sizeof(float))) / ROWS * ROWS);
  if (rows > chunk) {
    for (int64_t r = 0; r < rows; r += chunk) run(x + r * k, std::min(chunk, rows - r), w, n, k, bias, out + r * n);
    return;
  }
  const int64_t groups = (n + COLS - 1) / COLS;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    const char* range_end = reinterpret_cast<const char*>(w + std::min(n, g1 * COLS) * k);  // this thread's rows
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t c0 = g * COLS, cols = std::min<int64_t>(COLS, n - c0);
      const W* wg = w + c0 * k;
      const float* bg = bias != nullptr ? bias + c0 : nullptr;
      const char* next = reinterpret_cast<const char*>(wg + cols * k);
      const char* next_end = std::min(reinterpret_cast<const char*>(wg + (cols + COLS) * k), range_end);
      if (cols == COLS) {
        weight_group<COLS, W>(x, rows, wg, k, bg, out + c0, n, next, next_end);
        continue;
      }
      for (int64_t c = 0; c < cols; ++c)  // the last rows of an n that is not a multiple of 3
        weight_group<1, W>(x, rows, wg + c * k, k, bg != nullptr ? bg + c : nullptr, out + c0 + c, n, next, next_end);
    }
  });
}

#pragma GCC pop_options
#endif  // __x86_64__

// (native.dense_serves asks this for dense_gemm.cpp's kernel too: the same check.)
bool dense_linear_supported() { return pdserve_cpu::has_avx2_fma(); }

at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(dense_linear_supported(), "dense_linear: this CPU has no AVX2/FMA");
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "dense_linear: x must be a contiguous fp32 [..., k], got ", x.sizes(), " ", x.scalar_type());
  const bool bf16 = w.scalar_type() == at::kBFloat16;
  TORCH_CHECK(w.dim() == 2 && (bf16 || w.scalar_type() == at::kFloat) && w.is_contiguous() && w.size(1) == x.size(-1),
              "dense_linear: w must be a contiguous fp32 or bf16 [n, ", x.size(-1), "], got ", w.sizes(), " ",
              w.scalar_type());
  const int64_t rows = pdserve_rows::count(x), k = x.size(-1), n = w.size(0);
  TORCH_CHECK(k > 0 && k % LANES == 0, "dense_linear: k must be a positive multiple of 8, got ", k);
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "dense_linear: bias must be a contiguous fp32 [", n, "], got ", bias->sizes(), " ", bias->scalar_type());
    b = bias->data_ptr<float>();
  }
  at::Tensor out = at::empty(pdserve_rows::with_last(x, n), x.options());
  if (rows == 0 || n == 0) return out;
#if defined(__x86_64__)
  if (bf16) {
    run(x.data_ptr<float>(), rows, reinterpret_cast<const uint16_t*>(w.data_ptr()), n, k, b, out.data_ptr<float>());
  } else {
    run(x.data_ptr<float>(), rows, w.data_ptr<float>(), n, k, b, out.data_ptr<float>());
  }
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("dense_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("dense_linear_supported() -> bool", &dense_linear_supported);
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("dense_linear", &dense_linear); }
