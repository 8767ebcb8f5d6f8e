// Causal prefill attention in bf16 with the CPU's bf16 dot product (AVX512-BF16's vdpbf16ps): a
// flash-attention kernel, scores and softmax in fp32, never materialising a score matrix
// (model/layers/native.py says why this is ours and not a library's).
//
// q [n, heads, head_dim], keys/values [T, kv_heads, head_dim] (bf16, head_dim dense), the queries
// being the last n of the T positions: query p attends keys j <= T - n + p. Query head qh reads
// KV head qh / G (G = heads / kv_heads, GQA). Returns [n, heads, head_dim] bf16:
//   out[p, qh] = softmax_j(scale * q[p, qh] . K_j) @ V_j
//
// Why a kernel: torch's CPU flash attention runs a bf16 GEMM of K = head_dim (64) per block pair
// and a pass over an fp32 score block in memory between the two GEMMs; at 2,000 tokens that is
// ~115 GFLOP/s on a 2-core Zen 4 (half of a prefill), where vdpbf16ps peaks at ~385. Here a
// micro-block of ROWS query rows keeps its 32 scores per row, its running max and sum and its
// output rows in registers while it walks the keys in tiles of 32.
//
// Layout: each KV head's keys are packed once per call as pairs of dims ([head_dim/2][T]: one
// 32-bit word is two dims of a key, 16 keys per vector) and its values as pairs of keys
// ([T/2][head_dim]: one word is two keys' value of a dim), which is what vdpbf16ps multiplies.
// Work items are (KV head, block of QB query positions) with all G heads of a position in one
// block (they share the key range), ordered light/heavy alternately so torch's thread pool,
// which hands each thread a contiguous range, gets equal causal work per thread.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t TILE = 32;  // keys per tile: two vectors of 16 fp32 scores
constexpr int64_t QB = 32;    // query positions per work item

bool has_bf16_dot() {
#if defined(CPU_CAPABILITY_AVX512) && defined(__GNUC__)
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

#if defined(CPU_CAPABILITY_AVX512)
#pragma GCC push_options
#pragma GCC target("avx512bf16")

struct Problem {
  int64_t n, total, heads, kv_heads, group, head_dim, padded;
  int64_t q_pos_stride, q_head_stride;  // q's strides, in elements
  float scale;
};

inline __m512 dot2(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

// Keys of one KV head as [head_dim/2][padded] words, values as [padded/2][head_dim] words;
// positions >= total are zero (their scores are masked; a zero value adds nothing).
void pack_head(const uint16_t* keys, const uint16_t* values, int64_t row_stride, int64_t total,
               int64_t padded, int64_t head_dim, uint32_t* kp, uint32_t* vp) {
  const int64_t pairs = head_dim / 2;
  std::fill(kp, kp + pairs * padded, 0u);
  std::fill(vp, vp + padded * head_dim / 2, 0u);
  for (int64_t j = 0; j < total; ++j) {
    const uint32_t* k = reinterpret_cast<const uint32_t*>(keys + j * row_stride);
    for (int64_t d = 0; d < pairs; ++d) kp[d * padded + j] = k[d];
    const uint16_t* v = values + j * row_stride;
    uint16_t* out = reinterpret_cast<uint16_t*>(vp + (j / 2) * head_dim) + (j % 2);
    for (int64_t d = 0; d < head_dim; ++d) out[2 * d] = v[d];
  }
}

// One micro-block of ROWS query rows (a row is a (position, head)), walking all its keys.
template <int ROWS, int NC>
void attend_rows(const Problem& s, const uint16_t* const* qrow, const int64_t* limit, const uint32_t* kp,
                 const uint32_t* vp, uint16_t* const* orow, int live) {
  __m512 acc[ROWS][NC];
  __m512 lsum[ROWS];
  float mx[ROWS];
  alignas(64) uint32_t pw[ROWS][TILE / 2];
  for (int r = 0; r < ROWS; ++r) {
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_setzero_ps();
    lsum[r] = _mm512_setzero_ps();
    mx[r] = -std::numeric_limits<float>::infinity();
  }
  int64_t lo = limit[0], hi = limit[0];
  for (int r = 1; r < ROWS; ++r) lo = std::min(lo, limit[r]), hi = std::max(hi, limit[r]);
  const __m512 scale = _mm512_set1_ps(s.scale);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const uint32_t* const* qw = reinterpret_cast<const uint32_t* const*>(qrow);
  for (int64_t j0 = 0; j0 < hi; j0 += TILE) {
    __m512 sc[ROWS][2];
    for (int r = 0; r < ROWS; ++r) sc[r][0] = sc[r][1] = _mm512_setzero_ps();
    for (int64_t d = 0; d < s.head_dim / 2; ++d) {
      const __m512i k0 = _mm512_loadu_si512(kp + d * s.padded + j0);
      const __m512i k1 = _mm512_loadu_si512(kp + d * s.padded + j0 + 16);
      for (int r = 0; r < ROWS; ++r) {
        const __m512i qb = _mm512_set1_epi32(static_cast<int>(qw[r][d]));
        sc[r][0] = dot2(sc[r][0], qb, k0);
        sc[r][1] = dot2(sc[r][1], qb, k1);
      }
    }
    const bool edge = j0 + TILE > lo;
    for (int r = 0; r < ROWS; ++r) {
      __mmask16 m0 = 0xFFFF, m1 = 0xFFFF;
      if (edge) {
        const __m512i left = _mm512_set1_epi32(static_cast<int>(limit[r] - j0));
        m0 = _mm512_cmplt_epi32_mask(lane, left);
        m1 = _mm512_cmplt_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32(16)), left);
      }
      const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      const __m512 s0 = _mm512_mask_mul_ps(ninf, m0, sc[r][0], scale);
      const __m512 s1 = _mm512_mask_mul_ps(ninf, m1, sc[r][1], scale);
      const float tile_max = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1));
      const float next = std::max(mx[r], tile_max);
      if (next > mx[r]) {  // rescale what was summed under the old maximum
        const __m512 alpha = _mm512_set1_ps(std::exp(mx[r] - next));
        for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_mul_ps(acc[r][c], alpha);
        lsum[r] = _mm512_mul_ps(lsum[r], alpha);
        mx[r] = next;
      }
      const __m512 top = _mm512_set1_ps(next);
      using Vec = at::vec::Vectorized<float>;
      const __m512 p0 = _mm512_maskz_mov_ps(m0, Vec(_mm512_sub_ps(s0, top)).exp_u20());
      const __m512 p1 = _mm512_maskz_mov_ps(m1, Vec(_mm512_sub_ps(s1, top)).exp_u20());
      lsum[r] = _mm512_add_ps(lsum[r], _mm512_add_ps(p0, p1));
      _mm512_store_si512(pw[r], (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    }
    const int64_t key_pairs = std::min<int64_t>(TILE, hi - j0 + 1) / 2;
    const uint32_t* vt = vp + (j0 / 2) * s.head_dim;
    for (int64_t kpair = 0; kpair < key_pairs; ++kpair) {
      __m512i vv[NC];
      for (int c = 0; c < NC; ++c) vv[c] = _mm512_loadu_si512(vt + kpair * s.head_dim + c * 16);
      for (int r = 0; r < ROWS; ++r) {
        const __m512i pb = _mm512_set1_epi32(static_cast<int>(pw[r][kpair]));
        for (int c = 0; c < NC; ++c) acc[r][c] = dot2(acc[r][c], pb, vv[c]);
      }
    }
  }
  for (int r = 0; r < live; ++r) {
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(lsum[r]));
    for (int c = 0; c < NC; ++c) {
      const __m256bh out = _mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][c], inv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(orow[r] + c * 16), (__m256i)out);
    }
  }
}

// Rows of one work item (KV head g, positions [p0, p1)), ROWS at a time; a last short
// micro-block repeats its last row and stores only the live ones.
template <int ROWS, int NC>
void attend_item(const Problem& s, const uint16_t* q, int64_t g, int64_t p0, int64_t p1, const uint32_t* kp,
                 const uint32_t* vp, uint16_t* out) {
  const int64_t rows = (p1 - p0) * s.group;
  for (int64_t r0 = 0; r0 < rows; r0 += ROWS) {
    const uint16_t* qrow[ROWS];
    uint16_t* orow[ROWS];
    int64_t limit[ROWS];
    const int live = static_cast<int>(std::min<int64_t>(ROWS, rows - r0));
    for (int r = 0; r < ROWS; ++r) {
      const int64_t row = r0 + std::min(r, live - 1);
      const int64_t p = p0 + row / s.group, head = g * s.group + row % s.group;
      qrow[r] = q + p * s.q_pos_stride + head * s.q_head_stride;
      orow[r] = out + (p * s.heads + head) * s.head_dim;
      limit[r] = s.total - s.n + p + 1;
    }
    attend_rows<ROWS, NC>(s, qrow, limit, kp, vp, orow, live);
  }
}

template <int ROWS, int NC>
void run(const Problem& s, const uint16_t* q, const std::vector<uint32_t>& kp, const std::vector<uint32_t>& vp,
         uint16_t* out) {
  const int64_t blocks = (s.n + QB - 1) / QB;
  const int64_t per_head = s.padded * s.head_dim / 2;
  at::parallel_for(0, s.kv_heads * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / blocks, i = item % blocks;
      const int64_t b = (i % 2 == 0) ? i / 2 : blocks - 1 - i / 2;  // light, heavy, light, ...
      attend_item<ROWS, NC>(s, q, g, b * QB, std::min(s.n, (b + 1) * QB), kp.data() + g * per_head,
                            vp.data() + g * per_head, out);
    }
  });
}

#pragma GCC pop_options
#endif  // CPU_CAPABILITY_AVX512

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, double scale) {
  TORCH_CHECK(has_bf16_dot(), "prefill_attention: this CPU has no AVX512-BF16 (vdpbf16ps)");
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 3 && values.dim() == 3,
              "prefill_attention: q [n, heads, head_dim], keys/values [T, kv_heads, head_dim], got ", q.sizes(),
              " ", keys.sizes(), " ", values.sizes());
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && keys.scalar_type() == at::kBFloat16 &&
                  values.scalar_type() == at::kBFloat16,
              "prefill_attention: bfloat16 only, got ", q.scalar_type());
  TORCH_CHECK(keys.sizes() == values.sizes() && keys.strides() == values.strides(),
              "prefill_attention: keys and values differ in shape or layout");
  const int64_t n = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t total = keys.size(0), kv_heads = keys.size(1);
  TORCH_CHECK(keys.size(2) == head_dim && heads % kv_heads == 0 && total >= n && n > 0,
              "prefill_attention: heads ", heads, " over kv_heads ", kv_heads, ", head_dim ", head_dim, " vs ",
              keys.size(2), ", ", n, " queries over ", total, " keys");
  TORCH_CHECK(head_dim == 32 || head_dim == 64 || head_dim == 128,
              "prefill_attention: head_dim 32, 64 or 128, got ", head_dim);
  TORCH_CHECK(q.stride(2) == 1 && keys.stride(2) == 1 && keys.stride(1) == head_dim,
              "prefill_attention: head_dim and heads of keys must be dense");
  at::Tensor out = at::empty({n, heads, head_dim}, q.options());
#if defined(CPU_CAPABILITY_AVX512)
  const int64_t padded = (total + TILE - 1) / TILE * TILE;
  Problem s{n, total, heads, kv_heads, heads / kv_heads, head_dim, padded, q.stride(0), q.stride(1),
            static_cast<float>(scale)};
  const int64_t per_head = padded * head_dim / 2;
  std::vector<uint32_t> kp(kv_heads * per_head), vp(kv_heads * per_head);
  const auto* kptr = reinterpret_cast<const uint16_t*>(keys.data_ptr<at::BFloat16>());
  const auto* vptr = reinterpret_cast<const uint16_t*>(values.data_ptr<at::BFloat16>());
  at::parallel_for(0, kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      pack_head(kptr + g * head_dim, vptr + g * head_dim, keys.stride(0), total, padded, head_dim,
                kp.data() + g * per_head, vp.data() + g * per_head);
  });
  const auto* qptr = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  auto* optr = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  if (head_dim == 32) run<4, 2>(s, qptr, kp, vp, optr);
  if (head_dim == 64) run<4, 4>(s, qptr, kp, vp, optr);
  if (head_dim == 128) run<2, 8>(s, qptr, kp, vp, optr);
#endif
  return out;
}

bool prefill_attention_supported() { return has_bf16_dot(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("prefill_attention(Tensor q, Tensor keys, Tensor values, float scale) -> Tensor");
  m.def("prefill_attention_supported() -> bool", &prefill_attention_supported);
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("prefill_attention", &prefill_attention); }
