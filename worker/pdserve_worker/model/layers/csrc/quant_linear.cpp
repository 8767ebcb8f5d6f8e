// x @ W.T for a weight stored in blocks of 32 values along each row (GGUF's Q4_0 / Q4_1 / Q8_0),
// in fp32 FMA on AVX2 (every x86 CPU torch's own AVX2 or AVX512 builds run on has it).
//
// A block's value is d * q + m: q a 4-bit (0..15) or 8-bit (-128..127) integer, d and m fp16 (as
// GGUF stores them; Q4_0's m is -8 d, Q8_0's is 0); the input is fp32. So
//   y[r, n] = sum_g ( d[n, g] * sum_{k in g} x[r, k] q[n, k]  +  m[n, g] * sum_{k in g} x[r, k] )
// with the inner sums over exact integers in fp32 and d and m applied once per block: the value
// multiplied is the file's own, not a bf16 rounding of it (torch's int4 kernel rounds d and its
// zero to bf16, which is why matmul._compensated_zero exists).
//
// Why a kernel: torch's weight-only int4 kernel dequantizes the weight once per input row, so a
// 16-row decode step cost 16 GEMVs and a prefill chunk hundreds (its int8 route: two 4-bit
// planes). Here a block of 32 output rows by one group of 32 inputs is unpacked once into fp32 (4
// KB, L1) and every input row is multiplied by it (one or two rows, a batch-1 or -2 decode step,
// are multiplied straight from the bytes instead: `direct`). A row's sums run in the same order
// whatever the other rows are (per output, over groups in order), so a row's bits do not depend on
// its batch.
// Measured on a 2-vCPU Zen 3 (AVX2): ~40 G multiply-adds/s per core from 16 rows on, what two
// 8-wide FMA ports give at its reported 2.45 GHz (39 G/s); 16-bit integer dot products (vpmaddwd, 16-bit inputs with a scale per block) ran at the
// same rate there, so the inputs stay exact fp32 by default (8-bit inputs, faster but not exact:
// the opt-in int8 route below).
//
// Layout (built by matmul.pack_native): output rows padded to NB blocks of 32, K = G groups of 32.
//   q4: bytes [NB][G][16 pairs][32 rows]: q[32 nb + i, 32 g + 2 p] | q[32 nb + i, 32 g + 2 p + 1] << 4.
//   q8: int8 [NB][G][32 inputs][32 rows]: q[32 nb + i, 32 g + j].
//   scales: fp16 [NB][G][2][32]: d then m of the block's 32 rows.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_features.h"
#include "rows.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t GROUP = 32;   // values per block, and output rows per block of the layout
constexpr int64_t CHUNK = 128;  // input rows per work item (x's chunk stays in L2 across output blocks)
constexpr int TILE = 3;         // input rows per register tile: 12 accumulators of 8 floats
// Up to this many input rows skip the fp32 unpack (`direct`): 0.78x / 0.72x the time of all the
// default model's matrices at 1 / 2 rows (2026-12-06, 2-vCPU Zen 3); from 3 rows the unpacked
// block is reused enough (and 3 rows' accumulators and inputs would not fit the registers).
constexpr int64_t DIRECT_ROWS = 2;

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

struct Problem {
  const float* x;     // [rows, k] fp32
  const uint8_t* q;
  const uint16_t* scales;
  const float* xsum;  // [rows, groups]: each row's sum over each group
  int64_t rows, k, groups, n, blocks;
  bool wide;  // q8
  void* out;  // [rows, n] fp32 or bf16
  bool out_bf16;
  const int8_t* xq = nullptr;  // int8 route: x per block of 32 as dx * xq (quantize_rows), [rows, k]
  const float* dx = nullptr;   // [rows, groups]
};

// The block's values as fp32, 8 output rows (c) at a time: a 4-bit pair p gives inputs 2p (lo)
// and 2p + 1 (hi), an 8-bit row j gives input j. One copy for `unpack` and `direct`.
inline void q4_pair(const uint8_t* src, int p, int c, __m256& lo, __m256& hi) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + p * 32 + c * 8)));
  lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(0x0F)));
  hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}
inline __m256 q8_row(const uint8_t* src, int j, int c) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + j * 32 + c * 8))));
}

// The bytes of block (nb, g).
inline const uint8_t* block_bytes(const Problem& s, int64_t nb, int64_t g) {
  return s.q + (nb * s.groups + g) * GROUP * GROUP / (s.wide ? 1 : 2);
}

// Block (nb, g) as fp32 w[j][i]: input 32 g + j of output row 32 nb + i.
void unpack(const Problem& s, int64_t nb, int64_t g, float (*w)[GROUP]) {
  const uint8_t* src = block_bytes(s, nb, g);
  if (!s.wide) {
    for (int p = 0; p < 16; ++p)
      for (int c = 0; c < 4; ++c) {
        __m256 lo, hi;
        q4_pair(src, p, c, lo, hi);
        _mm256_store_ps(w[2 * p] + 8 * c, lo);
        _mm256_store_ps(w[2 * p + 1] + 8 * c, hi);
      }
    return;
  }
  for (int j = 0; j < 32; ++j)
    for (int c = 0; c < 4; ++c) _mm256_store_ps(w[j] + 8 * c, q8_row(src, j, c));
}

// Rows [r0, r0 + R) times the unpacked block (nb, g), added to their fp32 sums y[r][32].
template <int R>
void tile(const Problem& s, const float (*w)[GROUP], int64_t g, const float* d, const float* m, int64_t r0,
          float (*y)[GROUP]) {
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_setzero_ps();
  const float* x = s.x + r0 * s.k + g * GROUP;
  for (int j = 0; j < GROUP; ++j)
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * s.k + j);
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_fmadd_ps(xb, _mm256_load_ps(w[j] + 8 * c), acc[r][c]);
    }
  for (int r = 0; r < R; ++r) {
    const __m256 sum = _mm256_set1_ps(s.xsum[(r0 + r) * s.groups + g]);
    for (int c = 0; c < 4; ++c) {
      __m256 out = _mm256_loadu_ps(y[r] + 8 * c);
      out = _mm256_fmadd_ps(acc[r][c], _mm256_loadu_ps(d + 8 * c), out);
      out = _mm256_fmadd_ps(sum, _mm256_loadu_ps(m + 8 * c), out);
      _mm256_storeu_ps(y[r] + 8 * c, out);
    }
  }
}

// Rows [r0, r0 + R) (a decode step's few) times block (nb, g) straight from its bytes: each 8
// outputs' weights widened in registers and multiplied at once, where `unpack` + `tile` would
// store the block as 4 KB of fp32 and load it back for one or two rows. Every output's sum still
// runs over the group's 32 inputs in order, then d and m as in `tile`: the same bits.
template <int R>
void direct(const Problem& s, int64_t nb, int64_t g, const float* d, const float* m, int64_t r0, float (*y)[GROUP]) {
  const float* x = s.x + r0 * s.k + g * GROUP;
  const uint8_t* src = block_bytes(s, nb, g);
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_setzero_ps();
  if (s.wide) {
    for (int j = 0; j < GROUP; ++j) {
      __m256 xb[R];
      for (int r = 0; r < R; ++r) xb[r] = _mm256_broadcast_ss(x + r * s.k + j);
      for (int c = 0; c < 4; ++c) {
        const __m256 w = q8_row(src, j, c);
        for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(xb[r], w, acc[r][c]);
      }
    }
  } else {
    for (int p = 0; p < 16; ++p) {
      __m256 xl[R], xh[R];
      for (int r = 0; r < R; ++r) {
        xl[r] = _mm256_broadcast_ss(x + r * s.k + 2 * p);
        xh[r] = _mm256_broadcast_ss(x + r * s.k + 2 * p + 1);
      }
      for (int c = 0; c < 4; ++c) {
        __m256 lo, hi;
        q4_pair(src, p, c, lo, hi);
        for (int r = 0; r < R; ++r) {
          acc[r][c] = _mm256_fmadd_ps(xl[r], lo, acc[r][c]);
          acc[r][c] = _mm256_fmadd_ps(xh[r], hi, acc[r][c]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m256 sum = _mm256_set1_ps(s.xsum[(r0 + r) * s.groups + g]);
    for (int c = 0; c < 4; ++c) {
      __m256 out = _mm256_loadu_ps(y[r] + 8 * c);
      out = _mm256_fmadd_ps(acc[r][c], _mm256_loadu_ps(d + 8 * c), out);
      out = _mm256_fmadd_ps(sum, _mm256_loadu_ps(m + 8 * c), out);
      _mm256_storeu_ps(y[r] + 8 * c, out);
    }
  }
}

// ---- the int8-input route (4-bit weights): llama.cpp's Q4 x Q8 on AVX2, in this layout --------
//
// Each input row's block of 32 becomes dx * xq, xq = round(x / dx) in -127..127, dx = max|x| / 127
// (GGUF's Q8_0, as llama.cpp quantizes activations for its 4-bit matrices); the block's dot
// sum_k q[n, k] xq[r, k] is then exact in integers (vpmaddubsw: unsigned 4-bit weight times
// signed 8-bit input, pairs summed to 16 bits; 8 pairs fit: 8 * 2 * 15 * 127 < 2^15) and scaled
// once: y += d[n] dx[r] * dot + m[n] * sum_k x[r, k] (the m term from the exact fp32 input).
// A row's quantization and sums are its own, in a fixed order: batch invariance holds.

// Block (nb, g) as 16-bit lanes of (q[i, 2p], q[i, 2p + 1]): wp[2p] holds rows 0-7 and 16-23
// (by 128-bit lane), wp[2p + 1] rows 8-15 and 24-31 (unpacklo/hi work within lanes).
void unpack_pairs(const Problem& s, int64_t nb, int64_t g, __m256i* wp) {
  const uint8_t* src = block_bytes(s, nb, g);  // (4-bit: this route's only layout)
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int p = 0; p < 16; ++p) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + p * 32));
    const __m256i lo = _mm256_and_si256(b, low), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
    wp[2 * p] = _mm256_unpacklo_epi8(lo, hi);
    wp[2 * p + 1] = _mm256_unpackhi_epi8(lo, hi);
  }
}

// Rows [r0, r0 + R) times block (nb, g) in integers, added to their fp32 sums y[r][32].
template <int R>
void tile_i8(const Problem& s, const __m256i* wp, int64_t g, const float* d, const float* m, int64_t r0,
             float (*y)[GROUP]) {
  __m256i acc[R][4];  // 32-bit sums of output rows 0-7, 8-15, 16-23, 24-31
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_setzero_si256();
  const int8_t* xq = s.xq + r0 * s.k + g * GROUP;
  for (int half = 0; half < 2; ++half) {
    __m256i a16[R][2];
    for (int r = 0; r < R; ++r) a16[r][0] = a16[r][1] = _mm256_setzero_si256();
    for (int p = 8 * half; p < 8 * half + 8; ++p)
      for (int r = 0; r < R; ++r) {
        int16_t pair;
        std::memcpy(&pair, xq + r * s.k + 2 * p, sizeof(pair));
        const __m256i xb = _mm256_set1_epi16(pair);
        a16[r][0] = _mm256_add_epi16(a16[r][0], _mm256_maddubs_epi16(wp[2 * p], xb));
        a16[r][1] = _mm256_add_epi16(a16[r][1], _mm256_maddubs_epi16(wp[2 * p + 1], xb));
      }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 2; ++j) {  // lane 0 of a16[r][j]: rows 8 j.., lane 1: rows 16 + 8 j..
        const __m256i lo = _mm256_cvtepi16_epi32(_mm256_castsi256_si128(a16[r][j]));
        const __m256i hi = _mm256_cvtepi16_epi32(_mm256_extracti128_si256(a16[r][j], 1));
        acc[r][j] = _mm256_add_epi32(acc[r][j], lo);
        acc[r][2 + j] = _mm256_add_epi32(acc[r][2 + j], hi);
      }
  }
  for (int r = 0; r < R; ++r) {
    const __m256 dx = _mm256_set1_ps(s.dx[(r0 + r) * s.groups + g]);
    const __m256 sum = _mm256_set1_ps(s.xsum[(r0 + r) * s.groups + g]);
    for (int c = 0; c < 4; ++c) {
      __m256 out = _mm256_loadu_ps(y[r] + 8 * c);
      out = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][c]), _mm256_mul_ps(_mm256_loadu_ps(d + 8 * c), dx), out);
      out = _mm256_fmadd_ps(sum, _mm256_loadu_ps(m + 8 * c), out);
      _mm256_storeu_ps(y[r] + 8 * c, out);
    }
  }
}

// Each row's blocks of 32 as dx * xq (above): amax / 127 and round-to-nearest-even of x * 127 / amax.
void quantize_rows(const float* x, int64_t rows, int64_t k, int8_t* xq, float* dx) {
  const int64_t groups = k / GROUP;
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // packs work within 128-bit lanes
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t g = 0; g < groups; ++g) {
        const float* src = x + r * k + g * GROUP;
        __m256 v[4], amax = _mm256_setzero_ps();
        const __m256 sign = _mm256_set1_ps(-0.0f);
        for (int c = 0; c < 4; ++c) {
          v[c] = _mm256_loadu_ps(src + 8 * c);
          amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[c]));
        }
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, amax);
        const float top = *std::max_element(lanes, lanes + 8);
        // A block too small for 127 / top to be finite (|x| < ~4e-37, or all zero) counts as zero.
        const float inverse = top > 0.0f ? 127.0f / top : 0.0f;
        const bool usable = std::isfinite(inverse);
        dx[r * groups + g] = usable ? top / 127.0f : 0.0f;
        const __m256 scale = _mm256_set1_ps(usable ? inverse : 0.0f);
        __m256i i[4];
        for (int c = 0; c < 4; ++c) i[c] = _mm256_cvtps_epi32(_mm256_mul_ps(v[c], scale));
        const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + r * k + g * GROUP), _mm256_permutevar8x32_epi32(packed, order));
      }
  });
}

// fp32 rows to the output (bf16 through c10's conversion: torch's own rounding).
void store_rows(const Problem& s, int64_t nb, int64_t r0, int64_t r1, const float (*y)[GROUP]) {
  const int64_t cols = std::min<int64_t>(GROUP, s.n - nb * GROUP);
  for (int64_t r = r0; r < r1; ++r) {
    const float* src = y[r - r0];
    const int64_t at = r * s.n + nb * GROUP;
    if (!s.out_bf16) {
      std::memcpy(static_cast<float*>(s.out) + at, src, sizeof(float) * cols);
      continue;
    }
    c10::BFloat16* dst = static_cast<c10::BFloat16*>(s.out) + at;
    for (int64_t i = 0; i < cols; ++i) dst[i] = c10::BFloat16(src[i]);
  }
}

// Input rows [r0, r1) times output block nb.
void block(const Problem& s, int64_t nb, int64_t r0, int64_t r1) {
  alignas(64) float y[CHUNK][GROUP];
  std::memset(y, 0, sizeof(float) * GROUP * (r1 - r0));
  alignas(64) float w[GROUP][GROUP];
  __m256i wp[GROUP];
  alignas(32) float dm[2][GROUP];
  for (int64_t g = 0; g < s.groups; ++g) {
    const uint16_t* sc = s.scales + (nb * s.groups + g) * 2 * GROUP;
    for (int c = 0; c < 8; ++c)
      _mm256_store_ps(dm[c / 4] + 8 * (c % 4), _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 8 * c))));
    if (s.xq != nullptr) {
      unpack_pairs(s, nb, g, wp);
      int64_t r = r0;
      for (; r + 2 <= r1; r += 2) tile_i8<2>(s, wp, g, dm[0], dm[1], r, y + (r - r0));
      if (r < r1) tile_i8<1>(s, wp, g, dm[0], dm[1], r, y + (r - r0));
      continue;
    }
    if (r1 - r0 <= DIRECT_ROWS) {
      if (r1 - r0 == 1) direct<1>(s, nb, g, dm[0], dm[1], r0, y);
      else direct<2>(s, nb, g, dm[0], dm[1], r0, y);
      continue;
    }
    unpack(s, nb, g, w);
    int64_t r = r0;
    for (; r + TILE <= r1; r += TILE) tile<TILE>(s, w, g, dm[0], dm[1], r, y + (r - r0));
    if (r1 - r == 2) tile<2>(s, w, g, dm[0], dm[1], r, y + (r - r0));
    if (r1 - r == 1) tile<1>(s, w, g, dm[0], dm[1], r, y + (r - r0));
  }
  store_rows(s, nb, r0, r1, y);
}

// Each row's sum over each group of 32 inputs (the m term), in a fixed order: lanes of 8, then pairwise.
void group_sums(const float* x, int64_t rows, int64_t k, float* xsum) {
  const int64_t groups = k / GROUP;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t g = 0; g < groups; ++g) {
        __m256 sum = _mm256_setzero_ps();
        for (int c = 0; c < 4; ++c) sum = _mm256_add_ps(sum, _mm256_loadu_ps(x + r * k + g * GROUP + 8 * c));
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, sum);
        xsum[r * groups + g] = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
      }
  });
}

#pragma GCC pop_options
#endif  // __x86_64__

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, int64_t n, bool wide,
                        bool out_bf16, bool int8_inputs) {
  TORCH_CHECK(pdserve_cpu::has_avx2_fma_f16c(), "quant_linear: this CPU has no AVX2/FMA/F16C");
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "quant_linear: x must be a contiguous fp32 [..., k], got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(q.scalar_type() == at::kByte && q.is_contiguous() && scales.scalar_type() == at::kHalf &&
                  scales.is_contiguous(),
              "quant_linear: values uint8 and scales fp16, contiguous");
  TORCH_CHECK(!(int8_inputs && wide), "quant_linear: int8 inputs take 4-bit weights only");
  const int64_t rows = pdserve_rows::count(x), k = x.size(-1);
  TORCH_CHECK(k % GROUP == 0 && n > 0, "quant_linear: k a multiple of 32, got ", k, ", n ", n);
  const int64_t groups = k / GROUP, blocks = (n + GROUP - 1) / GROUP;
  TORCH_CHECK(q.numel() == blocks * groups * GROUP * GROUP / (wide ? 1 : 2) && scales.numel() == blocks * groups * 2 * GROUP,
              "quant_linear: ", q.numel(), " value bytes and ", scales.numel(), " scales do not hold ", n, " x ", k,
              wide ? " 8-bit" : " 4-bit", " values");
  at::Tensor out = at::empty(pdserve_rows::with_last(x, n), x.options().dtype(out_bf16 ? at::kBFloat16 : at::kFloat));
  if (rows == 0) return out;
#if defined(__x86_64__)
  at::Tensor xsum = at::empty({rows, groups}, x.options());
  group_sums(x.data_ptr<float>(), rows, k, xsum.data_ptr<float>());
  Problem s{x.data_ptr<float>(), q.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()),
            xsum.data_ptr<float>(), rows, k, groups, n, blocks, wide, out.data_ptr(), out_bf16};
  at::Tensor xq, dx;
  if (int8_inputs) {
    xq = at::empty({rows, k}, x.options().dtype(at::kChar));
    dx = at::empty({rows, groups}, x.options());
    quantize_rows(x.data_ptr<float>(), rows, k, xq.data_ptr<int8_t>(), dx.data_ptr<float>());
    s.xq = xq.data_ptr<int8_t>();
    s.dx = dx.data_ptr<float>();
  }
  const int64_t chunks = (rows + CHUNK - 1) / CHUNK;
  at::parallel_for(0, chunks * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t c = item / blocks, nb = item % blocks;
      block(s, nb, c * CHUNK, std::min(rows, (c + 1) * CHUNK));
    }
  });
#endif
  return out;
}

bool quant_linear_supported() { return pdserve_cpu::has_avx2_fma_f16c(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("quant_linear(Tensor x, Tensor q, Tensor scales, int n, bool wide, bool out_bf16, bool int8_inputs) -> Tensor");
  m.def("quant_linear_supported() -> bool", &quant_linear_supported);
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("quant_linear", &quant_linear); }
