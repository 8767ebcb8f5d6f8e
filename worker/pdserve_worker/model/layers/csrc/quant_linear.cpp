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
// KB, L1) and every input row is multiplied by it. A row's sums run in the same order whatever the
// other rows are (per output, over groups in order), so a row's bits do not depend on its batch.
// Measured on a 2-vCPU Zen 3 (AVX2): ~40 G multiply-adds/s per core from 16 rows on, what two
// 8-wide FMA ports give at its reported 2.45 GHz (39 G/s); 16-bit integer dot products (vpmaddwd, 16-bit inputs with a scale per block) ran at the
// same rate there, so the inputs stay exact fp32.
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
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t GROUP = 32;   // values per block, and output rows per block of the layout
constexpr int64_t CHUNK = 128;  // input rows per work item (x's chunk stays in L2 across output blocks)
constexpr int TILE = 3;         // input rows per register tile: 12 accumulators of 8 floats

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
};

// Block (nb, g) as fp32 w[j][i]: input 32 g + j of output row 32 nb + i.
void unpack(const Problem& s, int64_t nb, int64_t g, float (*w)[GROUP]) {
  if (!s.wide) {
    const uint8_t* src = s.q + (nb * s.groups + g) * GROUP * GROUP / 2;
    const __m256i low = _mm256_set1_epi32(0x0F);
    for (int p = 0; p < 16; ++p)
      for (int c = 0; c < 4; ++c) {
        const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + p * 32 + c * 8)));
        _mm256_store_ps(w[2 * p] + 8 * c, _mm256_cvtepi32_ps(_mm256_and_si256(b, low)));
        _mm256_store_ps(w[2 * p + 1] + 8 * c, _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)));
      }
    return;
  }
  const uint8_t* src = s.q + (nb * s.groups + g) * GROUP * GROUP;
  for (int j = 0; j < 32; ++j)
    for (int c = 0; c < 4; ++c) {
      const __m256i b = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + j * 32 + c * 8)));
      _mm256_store_ps(w[j] + 8 * c, _mm256_cvtepi32_ps(b));
    }
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
  alignas(32) float dm[2][GROUP];
  for (int64_t g = 0; g < s.groups; ++g) {
    unpack(s, nb, g, w);
    const uint16_t* sc = s.scales + (nb * s.groups + g) * 2 * GROUP;
    for (int c = 0; c < 8; ++c)
      _mm256_store_ps(dm[c / 4] + 8 * (c % 4), _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 8 * c))));
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

bool has_avx2_fma() {
#if defined(__x86_64__) && defined(__GNUC__)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, int64_t n, bool wide,
                        bool out_bf16) {
  TORCH_CHECK(has_avx2_fma(), "quant_linear: this CPU has no AVX2/FMA/F16C");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "quant_linear: x must be a contiguous fp32 [rows, k], got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(q.scalar_type() == at::kByte && q.is_contiguous() && scales.scalar_type() == at::kHalf &&
                  scales.is_contiguous(),
              "quant_linear: values uint8 and scales fp16, contiguous");
  const int64_t rows = x.size(0), k = x.size(1);
  TORCH_CHECK(k % GROUP == 0 && n > 0, "quant_linear: k a multiple of 32, got ", k, ", n ", n);
  const int64_t groups = k / GROUP, blocks = (n + GROUP - 1) / GROUP;
  TORCH_CHECK(q.numel() == blocks * groups * GROUP * GROUP / (wide ? 1 : 2) && scales.numel() == blocks * groups * 2 * GROUP,
              "quant_linear: ", q.numel(), " value bytes and ", scales.numel(), " scales do not hold ", n, " x ", k,
              wide ? " 8-bit" : " 4-bit", " values");
  at::Tensor out = at::empty({rows, n}, x.options().dtype(out_bf16 ? at::kBFloat16 : at::kFloat));
  if (rows == 0) return out;
#if defined(__x86_64__)
  at::Tensor xsum = at::empty({rows, groups}, x.options());
  group_sums(x.data_ptr<float>(), rows, k, xsum.data_ptr<float>());
  Problem s{x.data_ptr<float>(), q.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()),
            xsum.data_ptr<float>(), rows, k, groups, n, blocks, wide, out.data_ptr(), out_bf16};
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

bool quant_linear_supported() { return has_avx2_fma(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("quant_linear(Tensor x, Tensor q, Tensor scales, int n, bool wide, bool out_bf16) -> Tensor");
  m.def("quant_linear_supported() -> bool", &quant_linear_supported);
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("quant_linear", &quant_linear); }
