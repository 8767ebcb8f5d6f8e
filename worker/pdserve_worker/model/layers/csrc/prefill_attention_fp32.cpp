// Causal prefill attention in fp32 FMA on AVX2, for fp32 models and for bf16 models on CPUs
// without AVX512-BF16 (prefill_attention.cpp is the bf16 dot-product kernel of those that have
// it): a flash-attention kernel, scores and softmax in fp32, never materialising a score matrix.
//
// q [n, heads, head_dim], keys/values [T, kv_heads, head_dim] (fp32 or bf16, head_dim dense), the
// queries being the last n of the T positions: query p attends keys j <= T - n + p. Query head
// qh reads KV head qh / G (G = heads / kv_heads, GQA). Returns [n, heads, head_dim] in q's dtype:
//   out[p, qh] = softmax_j(scale * q[p, qh] . K_j) @ V_j
//
// Why a kernel: torch's CPU flash attention ran the default model's 256-token prefill at ~40
// GFLOP/s on this 2-vCPU Zen 3 (a tenth of a prefill, more for longer prompts): a GEMM of
// K = head_dim (64) per block pair and an fp32 score block in memory between the two GEMMs.
// Here a micro-block of ROWS (6) query rows keeps its 16 scores per row in registers while it
// walks the keys in tiles of 16, with its running max and sum beside them; its output rows
// (ROWS x head_dim, too many for AVX2's 16 registers) stay in L1, and each tile's values are
// added to them 16 values of head_dim at a time for all ROWS rows (12 accumulators, each value
// vector loaded once). Measured 2026-12-06 on the 2-vCPU Zen 3, 9 heads over 3 KV heads of 64,
// against torch's SDPA in the same process: 1.8-2.2x its speed at 128-512 tokens, 1.25x at
// 2,000, fp32 and bf16 (benchmarks/avx2_kernels.py).
//
// Layout: each KV head's keys are packed once per call as [T / 16][head_dim][16] fp32 (8 keys
// per vector, a tile's keys contiguous), its values as [T][head_dim] fp32 (a bf16 pool is
// widened here, once). Work items are (KV head, block of QB query positions) with all G heads of
// a position in one item (they share the key range), ordered light/heavy alternately so torch's
// thread pool, which hands each thread a contiguous range, gets equal causal work per thread.
// A query's arithmetic depends on its own row and keys only: a prompt prefilled whole or in
// chunks gets the same bits.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "avx2_ops.h"
#include "cpu_features.h"

#if defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t TILE = 16;  // keys per tile: two vectors of 8 fp32 scores
constexpr int64_t QB = 32;    // query positions per work item
constexpr int ROWS = 6;       // query rows per micro-block (12 score or value accumulators)

// Built for AVX2 only: ATen's Vectorized<float> (its exp) is the 8-wide one in such a build, and
// it is where this kernel was measured; AVX512 builds keep torch's SDPA for fp32.
bool supported() {
#if defined(CPU_CAPABILITY_AVX2)
  return pdserve_cpu::has_avx2_fma();
#else
  return false;
#endif
}

#if defined(CPU_CAPABILITY_AVX2)
#pragma GCC push_options
#pragma GCC target("avx2,fma")

using pdserve_avx2::lane_sum;

struct Problem {
  int64_t n, total, heads, kv_heads, group, head_dim, padded;
  float scale;
};

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}


// One KV head's keys as [padded / TILE][head_dim][TILE] (a tile's keys one contiguous 4 KB at
// head_dim 64), values as [padded][head_dim], fp32; positions >= total are zero (their scores
// are masked; a zero value adds nothing).
template <typename T>
void pack_head(const T* keys, const T* values, int64_t row_stride, int64_t total, int64_t padded, int64_t head_dim,
               float* kp, float* vp) {
  std::fill(kp, kp + head_dim * padded, 0.0f);
  std::fill(vp + total * head_dim, vp + padded * head_dim, 0.0f);
  for (int64_t j = 0; j < total; ++j) {
    const T* k = keys + j * row_stride;
    const T* v = values + j * row_stride;
    for (int64_t d = 0; d < head_dim; ++d) {
      kp[(j / TILE) * head_dim * TILE + d * TILE + j % TILE] = static_cast<float>(k[d]);
      vp[j * head_dim + d] = static_cast<float>(v[d]);
    }
  }
}

// Scores of ROWS query rows against the 16 keys of the tile at j0: sc[r][0..1]. (Local
// accumulators and sizes: summing into `sc` itself, GCC stored all 8 to memory every step.)
inline void tile_scores(const Problem& s, const float* const* qrow, const float* kp, int64_t j0, __m256 (&sc)[ROWS][2]) {
  const int64_t D = s.head_dim;
  const float* q[ROWS];
  __m256 a[ROWS][2];
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) {
    q[r] = qrow[r];
    a[r][0] = a[r][1] = _mm256_setzero_ps();
  }
  const float* k = kp + j0 * D;  // the tile's [head_dim][TILE]
  for (int64_t d = 0; d < D; ++d, k += TILE) {
    const __m256 k0 = _mm256_loadu_ps(k), k1 = _mm256_loadu_ps(k + 8);
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
      const __m256 qb = _mm256_broadcast_ss(q[r] + d);
      a[r][0] = _mm256_fmadd_ps(qb, k0, a[r][0]);
      a[r][1] = _mm256_fmadd_ps(qb, k1, a[r][1]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) sc[r][0] = a[r][0], sc[r][1] = a[r][1];
}

// acc[r][0..head_dim) += sum over the tile's `keys` keys of pw[r][t] * V[j0 + t], for the ROWS
// rows together, 16 values of head_dim at a time: 8 accumulators in registers, each value loaded
// once for the ROWS rows (one row at a time read every value vector once per row: 1.5x the loads).
inline void add_values(const Problem& s, const float (*pw)[TILE], const float* vp, int64_t j0, int64_t keys,
                       float (*acc)[128]) {
  const int64_t D = s.head_dim;
  const float* v = vp + j0 * D;
  int64_t c0 = 0;
  for (; c0 + 16 <= D; c0 += 16) {
    __m256 a[ROWS][2];
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
      a[r][0] = _mm256_load_ps(acc[r] + c0);
      a[r][1] = _mm256_load_ps(acc[r] + c0 + 8);
    }
    for (int64_t t = 0; t < keys; ++t) {
      const __m256 v0 = _mm256_loadu_ps(v + t * D + c0), v1 = _mm256_loadu_ps(v + t * D + c0 + 8);
#pragma GCC unroll 8
      for (int r = 0; r < ROWS; ++r) {
        const __m256 pb = _mm256_broadcast_ss(pw[r] + t);
        a[r][0] = _mm256_fmadd_ps(pb, v0, a[r][0]);
        a[r][1] = _mm256_fmadd_ps(pb, v1, a[r][1]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
      _mm256_store_ps(acc[r] + c0, a[r][0]);
      _mm256_store_ps(acc[r] + c0 + 8, a[r][1]);
    }
  }
  if (c0 < D) {  // a last 8 of a head_dim that is not a multiple of 16
    __m256 a[ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) a[r] = _mm256_load_ps(acc[r] + c0);
    for (int64_t t = 0; t < keys; ++t) {
      const __m256 v0 = _mm256_loadu_ps(v + t * D + c0);
#pragma GCC unroll 8
      for (int r = 0; r < ROWS; ++r) a[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(pw[r] + t), v0, a[r]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) _mm256_store_ps(acc[r] + c0, a[r]);
  }
}

// One micro-block of ROWS query rows (a row is a (position, head)), walking all its keys; a
// row's output is written to orow[r] (fp32, head_dim values) for the `live` rows.
void attend_rows(const Problem& s, const float* const* qrow, const int64_t* limit, const float* kp, const float* vp,
                 float* const* orow, int live) {
  alignas(32) float acc[ROWS][128];
  alignas(32) float pw[ROWS][TILE];
  __m256 lsum[ROWS];
  float mx[ROWS];
  for (int r = 0; r < ROWS; ++r) {
    std::fill(acc[r], acc[r] + s.head_dim, 0.0f);
    lsum[r] = _mm256_setzero_ps();
    mx[r] = -std::numeric_limits<float>::infinity();
  }
  int64_t lo = limit[0], hi = limit[0];
  for (int r = 1; r < ROWS; ++r) lo = std::min(lo, limit[r]), hi = std::max(hi, limit[r]);
  const __m256 scale = _mm256_set1_ps(s.scale);
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  using Vec = at::vec::Vectorized<float>;
  for (int64_t j0 = 0; j0 < hi; j0 += TILE) {
    __m256 sc[ROWS][2];
    tile_scores(s, qrow, kp, j0, sc);
    const bool edge = j0 + TILE > lo;
    for (int r = 0; r < ROWS; ++r) {
      __m256 m0 = _mm256_castsi256_ps(_mm256_set1_epi32(-1)), m1 = m0;
      if (edge) {
        const __m256i left = _mm256_set1_epi32(static_cast<int>(limit[r] - j0));
        m0 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(left, lane));
        m1 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(left, _mm256_add_epi32(lane, _mm256_set1_epi32(8))));
      }
      const __m256 s0 = _mm256_blendv_ps(ninf, _mm256_mul_ps(sc[r][0], scale), m0);
      const __m256 s1 = _mm256_blendv_ps(ninf, _mm256_mul_ps(sc[r][1], scale), m1);
      const float next = std::max(mx[r], hmax(_mm256_max_ps(s0, s1)));
      if (next > mx[r]) {  // rescale what was summed under the old maximum
        const float alpha = std::exp(mx[r] - next);
        const __m256 a = _mm256_set1_ps(alpha);
        for (int64_t d = 0; d < s.head_dim; d += 8)
          _mm256_store_ps(acc[r] + d, _mm256_mul_ps(_mm256_load_ps(acc[r] + d), a));
        lsum[r] = _mm256_mul_ps(lsum[r], a);
        mx[r] = next;
      }
      const __m256 top = _mm256_set1_ps(next);
      const __m256 p0 = _mm256_and_ps(m0, __m256(Vec(_mm256_sub_ps(s0, top)).exp_u20()));
      const __m256 p1 = _mm256_and_ps(m1, __m256(Vec(_mm256_sub_ps(s1, top)).exp_u20()));
      lsum[r] = _mm256_add_ps(lsum[r], _mm256_add_ps(p0, p1));
      _mm256_store_ps(pw[r], p0);
      _mm256_store_ps(pw[r] + 8, p1);
    }
    const int64_t keys = std::min<int64_t>(TILE, hi - j0);
    add_values(s, pw, vp, j0, keys, acc);
  }
  for (int r = 0; r < live; ++r) {
    const __m256 inv = _mm256_set1_ps(1.0f / lane_sum(lsum[r]));
    for (int64_t d = 0; d < s.head_dim; d += 8)
      _mm256_storeu_ps(orow[r] + d, _mm256_mul_ps(_mm256_load_ps(acc[r] + d), inv));
  }
}

// Rows of one work item (KV head g, positions [p0, p1)), ROWS at a time; a last short
// micro-block repeats its last row and stores only the live ones. q and out: [n, heads, head_dim].
void attend_item(const Problem& s, const float* q, int64_t g, int64_t p0, int64_t p1, const float* kp,
                 const float* vp, float* out) {
  const int64_t rows = (p1 - p0) * s.group;
  for (int64_t r0 = 0; r0 < rows; r0 += ROWS) {
    const float* qrow[ROWS];
    float* orow[ROWS];
    int64_t limit[ROWS];
    const int live = static_cast<int>(std::min<int64_t>(ROWS, rows - r0));
    for (int r = 0; r < ROWS; ++r) {
      const int64_t row = r0 + std::min(r, live - 1);
      const int64_t p = p0 + row / s.group, head = g * s.group + row % s.group;
      qrow[r] = q + (p * s.heads + head) * s.head_dim;
      orow[r] = out + (p * s.heads + head) * s.head_dim;
      limit[r] = s.total - s.n + p + 1;
    }
    attend_rows(s, qrow, limit, kp, vp, orow, live);
  }
}

void run(const Problem& s, const float* q, const std::vector<float>& kp, const std::vector<float>& vp, float* out) {
  const int64_t blocks = (s.n + QB - 1) / QB;
  const int64_t per_head = s.padded * s.head_dim;
  at::parallel_for(0, s.kv_heads * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / blocks, i = item % blocks;
      const int64_t b = (i % 2 == 0) ? i / 2 : blocks - 1 - i / 2;  // light, heavy, light, ...
      attend_item(s, q, g, b * QB, std::min(s.n, (b + 1) * QB), kp.data() + g * per_head, vp.data() + g * per_head,
                  out);
    }
  });
}

template <typename T>
void pack_all(const at::Tensor& keys, const at::Tensor& values, const Problem& s, std::vector<float>& kp,
              std::vector<float>& vp) {
  const int64_t per_head = s.padded * s.head_dim;
  const T* kptr = keys.data_ptr<T>();
  const T* vptr = values.data_ptr<T>();
  at::parallel_for(0, s.kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      pack_head<T>(kptr + g * s.head_dim, vptr + g * s.head_dim, keys.stride(0), s.total, s.padded, s.head_dim,
                   kp.data() + g * per_head, vp.data() + g * per_head);
  });
}

#pragma GCC pop_options
#endif  // CPU_CAPABILITY_AVX2

at::Tensor prefill_attention_fp32(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                  double scale) {
  TORCH_CHECK(supported(), "prefill_attention_fp32: built for AVX2 CPUs with FMA only");
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 3 && values.dim() == 3,
              "prefill_attention_fp32: q [n, heads, head_dim], keys/values [T, kv_heads, head_dim], got ", q.sizes(),
              " ", keys.sizes(), " ", values.sizes());
  const auto type = q.scalar_type();
  TORCH_CHECK((type == at::kFloat || type == at::kBFloat16) && keys.scalar_type() == type &&
                  values.scalar_type() == type,
              "prefill_attention_fp32: q, keys and values all float32 or all bfloat16, got ", type, ", ",
              keys.scalar_type(), ", ", values.scalar_type());
  TORCH_CHECK(keys.sizes() == values.sizes() && keys.strides() == values.strides(),
              "prefill_attention_fp32: keys and values differ in shape or layout");
  const int64_t n = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t total = keys.size(0), kv_heads = keys.size(1);
  TORCH_CHECK(keys.size(2) == head_dim && kv_heads > 0 && heads % kv_heads == 0 && total >= n && n > 0,
              "prefill_attention_fp32: heads ", heads, " over kv_heads ", kv_heads, ", head_dim ", head_dim, " vs ",
              keys.size(2), ", ", n, " queries over ", total, " keys");
  TORCH_CHECK(head_dim % 8 == 0 && head_dim <= 128, "prefill_attention_fp32: head_dim a multiple of 8 up to 128, got ",
              head_dim);
  TORCH_CHECK(keys.stride(2) == 1 && keys.stride(1) == head_dim,
              "prefill_attention_fp32: head_dim and heads of keys must be dense, got strides ", keys.strides());
  at::Tensor qf = q.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({n, heads, head_dim}, qf.options());
#if defined(CPU_CAPABILITY_AVX2)
  const int64_t padded = (total + TILE - 1) / TILE * TILE;
  const Problem s{n, total, heads, kv_heads, heads / kv_heads, head_dim, padded, static_cast<float>(scale)};
  std::vector<float> kp(kv_heads * padded * head_dim), vp(kv_heads * padded * head_dim);
  if (type == at::kFloat) {
    pack_all<float>(keys, values, s, kp, vp);
  } else {
    pack_all<c10::BFloat16>(keys, values, s, kp, vp);
  }
  run(s, qf.data_ptr<float>(), kp, vp, out.data_ptr<float>());
#endif
  return type == at::kFloat ? out : out.to(type);
}

bool prefill_attention_fp32_supported() { return supported(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("prefill_attention_fp32(Tensor q, Tensor keys, Tensor values, float scale) -> Tensor");
  m.def("prefill_attention_fp32_supported() -> bool", &prefill_attention_fp32_supported);
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("prefill_attention_fp32", &prefill_attention_fp32); }
