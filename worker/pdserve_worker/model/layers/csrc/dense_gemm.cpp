// x @ W.T (+ bias) for an fp32 or bf16 weight W [n, k] as the model holds it, for fp32 inputs of
// many rows (prefill chunks: matmul.DENSE_KERNEL_MAX_ROWS says where dense_linear.cpp's small-M
// kernel stops), in fp32 FMA on AVX2. A bf16 weight is widened to fp32 (exactly) as it is
// packed, so it gives the bits of the same values held in fp32.
//
// Why a kernel: these products are compute bound, and torch's fp32 GEMM (MKL here) and oneDNN's
// prepacked one ran them at 120-150 GFLOP/s on this 2-vCPU Zen 3, whose two cores' FMA ports
// give ~248 (a register-only FMA loop, 2026-12-06). The classic register tile of BLAS libraries
// (BLIS's, GotoBLAS's) does better here: 1.1-1.25x torch's speed at 64-256 rows of SmolLM2-135M's
// shapes in the same process (benchmarks/README.md has the figures).
//
// The tile: 6 input rows by 16 outputs, 12 accumulators of 8 outputs each; at every k, two
// vectors of 16 weights and each input row's value broadcast. The weights for a tile must be
// 16 outputs side by side per k, so each thread copies its 16 weight rows at a time transposed
// ("packed", 8 x 8 blocks through registers) into a buffer that stays in L1/L2 while every input
// row passes over it; the weight as the model holds it is read once per pass and not copied
// anywhere else (dense_linear.cpp's decode kernel reads the same tensor). Inputs of more rows
// than fit in L2 (X_BYTES) pass over the weights in chunks of that many.
//
// Each output is one FMA chain over k in order, then + bias: its bits depend only on its own
// input row and weight row, never on the other rows or on the chunking (batch invariance).
// They are not dense_linear's bits (that one sums 8 lanes along k), so a row computed here and
// there may differ in its last bits; matmul.Linear keeps a decode step's rows (up to
// DENSE_KERNEL_MAX_ROWS) on dense_linear so a stream's bits do not depend on its batch.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "avx2_ops.h"
#include "cpu_features.h"
#include "rows.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t PANEL = 16;            // outputs per tile (two AVX2 vectors)
constexpr int TILE_ROWS = 6;             // input rows per tile: 12 accumulators + 2 weights + 1 input
constexpr int64_t X_BYTES = 2048 * 1024;  // input rows per pass over the weights: they stay in L2

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma")

using pdserve_avx2::load8;
using pdserve_avx2::widen;

// out[j * PANEL + c] = w[c * k + j] (as fp32) for the panel's `cols` weight rows (c < cols; zeros beyond).
template <typename W>
void pack_panel(const W* w, int64_t cols, int64_t k, float* out) {
  if (cols < PANEL) {
    std::fill(out, out + k * PANEL, 0.0f);
    for (int64_t c = 0; c < cols; ++c)
      for (int64_t j = 0; j < k; ++j) out[j * PANEL + c] = widen(w[c * k + j]);
    return;
  }
  for (int64_t c0 = 0; c0 < PANEL; c0 += 8) {
    for (int64_t j0 = 0; j0 < k; j0 += 8) {  // an 8 x 8 block transposed in registers
      __m256 r[8];
      for (int i = 0; i < 8; ++i) r[i] = load8(w + (c0 + i) * k + j0);
      const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
      const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
      const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
      const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
      const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
      const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
      const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
      const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
      float* o = out + j0 * PANEL + c0;
      _mm256_storeu_ps(o + 0 * PANEL, _mm256_permute2f128_ps(u0, u4, 0x20));
      _mm256_storeu_ps(o + 1 * PANEL, _mm256_permute2f128_ps(u1, u5, 0x20));
      _mm256_storeu_ps(o + 2 * PANEL, _mm256_permute2f128_ps(u2, u6, 0x20));
      _mm256_storeu_ps(o + 3 * PANEL, _mm256_permute2f128_ps(u3, u7, 0x20));
      _mm256_storeu_ps(o + 4 * PANEL, _mm256_permute2f128_ps(u0, u4, 0x31));
      _mm256_storeu_ps(o + 5 * PANEL, _mm256_permute2f128_ps(u1, u5, 0x31));
      _mm256_storeu_ps(o + 6 * PANEL, _mm256_permute2f128_ps(u2, u6, 0x31));
      _mm256_storeu_ps(o + 7 * PANEL, _mm256_permute2f128_ps(u3, u7, 0x31));
    }
  }
}

// out[r, c] = x[r] . panel column c (+ bias[c]) for R rows and the panel's `cols` outputs.
// (`#pragma GCC unroll`: without it GCC kept the accumulator array on the stack, 3x slower.)
template <int R>
void tile(const float* x, int64_t k, const float* panel, const float* bias, int64_t cols, float* out, int64_t n) {
  __m256 acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t j = 0; j < k; ++j) {
    const __m256 w0 = _mm256_loadu_ps(panel + j * PANEL), w1 = _mm256_loadu_ps(panel + j * PANEL + 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(x + r * k + j);
      acc[r][0] = _mm256_fmadd_ps(a, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(a, w1, acc[r][1]);
    }
  }
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i low = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(cols)), lane);
  const __m256i high = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(cols) - 8), lane);
  __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
  if (bias != nullptr) {
    b0 = _mm256_maskload_ps(bias, low);
    b1 = _mm256_maskload_ps(bias + 8, high);
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm256_maskstore_ps(out + r * n, low, bias != nullptr ? _mm256_add_ps(acc[r][0], b0) : acc[r][0]);
    _mm256_maskstore_ps(out + r * n + 8, high, bias != nullptr ? _mm256_add_ps(acc[r][1], b1) : acc[r][1]);
  }
}

// Every input row over one packed panel: full tiles of TILE_ROWS, then the remainder.
void rows_over_panel(const float* x, int64_t rows, int64_t k, const float* panel, const float* bias, int64_t cols,
                     float* out, int64_t n) {
  int64_t r = 0;
  for (; r + TILE_ROWS <= rows; r += TILE_ROWS) tile<TILE_ROWS>(x + r * k, k, panel, bias, cols, out + r * n, n);
  const float* xr = x + r * k;
  float* o = out + r * n;
  switch (rows - r) {
    case 5: tile<5>(xr, k, panel, bias, cols, o, n); break;
    case 4: tile<4>(xr, k, panel, bias, cols, o, n); break;
    case 3: tile<3>(xr, k, panel, bias, cols, o, n); break;
    case 2: tile<2>(xr, k, panel, bias, cols, o, n); break;
    case 1: tile<1>(xr, k, panel, bias, cols, o, n); break;
    default: break;
  }
}

template <typename W>
void run(const float* x, int64_t rows, const W* w, int64_t n, int64_t k, const float* bias, float* out) {
  const int64_t chunk = std::max<int64_t>(TILE_ROWS, X_BYTES / (k * int64_t(sizeof(float))) / TILE_ROWS * TILE_ROWS);
  const int64_t panels = (n + PANEL - 1) / PANEL;
  for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
    const int64_t count = std::min(chunk, rows - r0);
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
      std::vector<float> panel(static_cast<size_t>(k * PANEL));
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t c0 = p * PANEL, cols = std::min(PANEL, n - c0);
        pack_panel(w + c0 * k, cols, k, panel.data());
        rows_over_panel(x + r0 * k, count, k, panel.data(), bias != nullptr ? bias + c0 : nullptr, cols,
                        out + r0 * n + c0, n);
      }
    });
  }
}

#pragma GCC pop_options
#endif  // __x86_64__

at::Tensor dense_gemm(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(pdserve_cpu::has_avx2_fma(), "dense_gemm: this CPU has no AVX2/FMA");
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "dense_gemm: x must be a contiguous fp32 [..., k], got ", x.sizes(), " ", x.scalar_type());
  const bool bf16 = w.scalar_type() == at::kBFloat16;
  TORCH_CHECK(w.dim() == 2 && (bf16 || w.scalar_type() == at::kFloat) && w.is_contiguous() && w.size(1) == x.size(-1),
              "dense_gemm: w must be a contiguous fp32 or bf16 [n, ", x.size(-1), "], got ", w.sizes(), " ",
              w.scalar_type());
  const int64_t rows = pdserve_rows::count(x), k = x.size(-1), n = w.size(0);
  TORCH_CHECK(k > 0 && k % 8 == 0, "dense_gemm: k must be a positive multiple of 8, got ", k);
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "dense_gemm: bias must be a contiguous fp32 [", n, "], got ", bias->sizes(), " ", bias->scalar_type());
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
  m.def("dense_gemm(Tensor x, Tensor w, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("dense_gemm", &dense_gemm); }
