// Decode attention over a KV pool through block tables: one query token per row, every row over
// exactly its own keys, all rows of a step in one call (model/layers/native.py says why
// this is ours and not a library's).
//
// Row b's key j (0 <= j < lengths[b]) is keys[tables[b][j / B], j % B] (B = block_tokens), where
// keys/values are [blocks, block_tokens, kv_heads, head_dim] with any block stride (a slot pool is
// one block of max_len tokens per slot, its slots layer-interleaved) and each block dense. Query
// head qh reads KV head qh / G (G = heads / kv_heads, GQA):
//   out[b, qh] = softmax_j(scale * q[b, qh] . K_j) @ V_j
//
// A row's keys are cut into parts of PART keys (flash-decoding's split, so one long row still
// uses every thread); each part reads its keys' whole rows (all KV heads: contiguous memory)
// once for the scores and once for the values, and the parts of a row are merged in order.
// The arithmetic of a row depends only on its query, its keys and its length: the loops run in
// a fixed order, the cut points are fixed multiples of PART, and nothing sums across rows. So a
// row gives the same bits alone or in any batch (batch invariance,
// tests/unit/test_batch_invariance.py), which torch's SDPA only gives when each row is its own
// call. Scores and accumulators are fp32 whatever the pool's dtype; exp is ATen's vectorized one.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;

// Calls fn.template operator()<T>() for the model dtypes the ops take (fp32, bf16, fp16).
template <typename Fn>
inline void dispatch(at::ScalarType type, const char* what, Fn&& fn) {
  switch (type) {
    case at::kFloat: fn.template operator()<float>(); break;
    case at::kBFloat16: fn.template operator()<c10::BFloat16>(); break;
    case at::kHalf: fn.template operator()<c10::Half>(); break;
    default: TORCH_CHECK(false, what, ": dtype float32, bfloat16 or float16, got ", type);
  }
}
constexpr int64_t PART = 64;  // keys per part

struct Shape {
  int64_t batch, heads, kv_heads, head_dim, group, max_blocks, block_tokens, pool_blocks, block_stride;
};

struct Part {
  int64_t row, start, stop;  // keys [start, stop) of row `row`
};

// One head_dim chunk (Vec::size() values) of a pool row, as fp32.
template <typename T>
inline Vec load_chunk(const T* src) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(src);
  } else {
    Vec out;
    at::vec::load_to_float<T>(src, out);  // a half-width load widened in registers
    return out;
  }
}

inline float hsum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, v);
}

// Keys [start, stop) of a row in order: fn(index from start, pointer to the key's row of KV head 0).
template <typename T, typename Fn>
inline void for_each_key(const T* pool, const int64_t* table, const Part& p, const Shape& s, Fn&& fn) {
  const int64_t stride = s.kv_heads * s.head_dim;
  int64_t j = p.start;
  while (j < p.stop) {
    const int64_t block = j / s.block_tokens, first = j % s.block_tokens;
    const int64_t n = std::min(s.block_tokens - first, p.stop - j);
    const T* base = pool + table[block] * s.block_stride + first * stride;
    for (int64_t t = 0; t < n; ++t) fn(j - p.start + t, base + t * stride);
    j += n;
  }
}

// scores[g * n + i] += q[g] . k for GT query heads sharing one KV head's key k (head_dim D):
// the key's chunks are converted once for all GT queries.
template <int GT, typename T>
inline void tile_scores(const float* q, const T* k, int64_t D, float* scores, int64_t n, int64_t i) {
  Vec acc[GT];
  for (int g = 0; g < GT; ++g) acc[g] = Vec(0.0f);
  for (int64_t d = 0; d < D; d += Vec::size()) {
    const Vec kv = load_chunk(k + d);
    for (int g = 0; g < GT; ++g) acc[g] = at::vec::fmadd(Vec::loadu(q + g * D + d), kv, acc[g]);
  }
  for (int g = 0; g < GT; ++g) scores[g * n + i] = hsum(acc[g]);
}

// The most head_dim chunks (C divided by a power of two) whose GT x B accumulators, one value chunk
// and GT weights fit the vector registers: 16 with AVX2, 32 with AVX512 (Vec of 16 floats).
constexpr int chunks_in_registers(int GT, int C) {
  const int registers = Vec::size() == 16 ? 32 : 16;
  int b = C;
  while (b > 1 && (GT * b + GT + 1 > registers || C % b != 0)) b /= 2;
  return b;
}

// out[g] = sum_i w[g * n + i] * V_i for GT query heads sharing KV head h, over the part's keys, B
// chunks of head_dim (C of them) at a time: GT x B accumulators, one value chunk and the GT weights
// fit the registers (all C chunks at once did not for GQA groups of 3-4 at head_dim 64: GCC
// kept the accumulators on the stack). Each further B chunks read the part's value rows again, from
// L1/L2. An output's sum runs over the keys in order whatever B is, so the bits are the same.
template <int GT, int C, typename T>
inline void tile_values(const float* w, int64_t n, const T* values, const int64_t* table, const Part& p,
                        const Shape& s, int64_t h, float* out) {
  constexpr int B = chunks_in_registers(GT, C);
  static_assert(C % B == 0, "tile_values: head_dim's chunks in whole groups");
  for (int c0 = 0; c0 < C; c0 += B) {
    Vec acc[GT][B];
    for (int g = 0; g < GT; ++g)
      for (int c = 0; c < B; ++c) acc[g][c] = Vec(0.0f);
    for_each_key(values, table, p, s, [&](int64_t i, const T* row) {
      const T* v = row + (h * C + c0) * Vec::size();
      Vec weight[GT];
      for (int g = 0; g < GT; ++g) weight[g] = Vec(w[g * n + i]);
      for (int c = 0; c < B; ++c) {
        const Vec vv = load_chunk(v + c * Vec::size());
        for (int g = 0; g < GT; ++g) acc[g][c] = at::vec::fmadd(weight[g], vv, acc[g][c]);
      }
    });
    for (int g = 0; g < GT; ++g)
      for (int c = 0; c < B; ++c) acc[g][c].store(out + g * C * Vec::size() + (c0 + c) * Vec::size());
  }
}

// The same for any head_dim (a multiple of Vec::size()): accumulators in memory.
template <int GT, typename T>
inline void tile_values_any(const float* w, int64_t n, const T* values, const int64_t* table, const Part& p,
                            const Shape& s, int64_t h, float* out) {
  const int64_t D = s.head_dim;
  std::fill(out, out + GT * D, 0.0f);
  for_each_key(values, table, p, s, [&](int64_t i, const T* row) {
    const T* v = row + h * D;
    for (int64_t d = 0; d < D; d += Vec::size()) {
      const Vec vv = load_chunk(v + d);
      for (int g = 0; g < GT; ++g) {
        at::vec::fmadd(Vec(w[g * n + i]), vv, Vec::loadu(out + g * D + d)).store(out + g * D + d);
      }
    }
  });
}

// Calls fn.template operator()<GT>(first query head of the tile) over G in tiles of up to 4.
template <typename Fn>
inline void for_each_tile(int64_t G, Fn&& fn) {
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    switch (std::min<int64_t>(4, G - g0)) {
      case 1: fn.template operator()<1>(g0); break;
      case 2: fn.template operator()<2>(g0); break;
      case 3: fn.template operator()<3>(g0); break;
      default: fn.template operator()<4>(g0); break;
    }
  }
}

// One part of one row: every query head's weighted values (not yet divided), max score and sum
// of exp, written to result = acc [heads, head_dim], then max [heads], then sum [heads].
template <typename T>
void attend_part(const float* qf, const T* keys, const T* values, const int64_t* table, const Part& p,
                 const Shape& s, std::vector<float>& scores_buf, float* result) {
  const int64_t H = s.heads, G = s.group, D = s.head_dim, n = p.stop - p.start;
  scores_buf.resize(static_cast<size_t>(H * n));
  float* scores = scores_buf.data();  // [heads, n]
  const int64_t row_bytes = s.kv_heads * s.head_dim * static_cast<int64_t>(sizeof(T));
  for_each_key(keys, table, p, s, [&](int64_t i, const T* row) {
    // The key's value row (same place in the value pool) asked for now, whole: the value passes
    // below read it one KV head (a third of its cache lines here) at a time, which DRAM streams
    // badly; fetched during the score pass it is in L2 by then. 1.1-1.4x this kernel's speed at
    // a batch-16 step of the default model (320 keys a row; 2026-12-06, 2-vCPU Zen 3), same bits.
    const char* value_row = reinterpret_cast<const char*>(values + (row - keys));
    for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(value_row + b, 0, 2);
    for (int64_t h = 0; h < s.kv_heads; ++h) {
      for_each_tile(G, [&]<int GT>(int64_t g0) {
        tile_scores<GT>(qf + (h * G + g0) * D, row + h * D, D, scores + (h * G + g0) * n, n, i);
      });
    }
  });
  float* acc = result;
  float* tops = result + H * D;
  float* sums = tops + H;
  for (int64_t qh = 0; qh < H; ++qh) {
    float* sc = scores + qh * n;
    tops[qh] = at::vec::reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, sc, n);
    at::vec::map([top = tops[qh]](Vec x) { return (x - Vec(top)).exp(); }, sc, sc, n);
    sums[qh] = at::vec::reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, sc, n);
  }
  for (int64_t h = 0; h < s.kv_heads; ++h) {  // one pass over the part's rows per KV head
    for_each_tile(G, [&]<int GT>(int64_t g0) {
      const float* w = scores + (h * G + g0) * n;
      float* out = acc + (h * G + g0) * D;
      switch (D / Vec::size()) {
        case 4: tile_values<GT, 4>(w, n, values, table, p, s, h, out); break;
        case 8: tile_values<GT, 8>(w, n, values, table, p, s, h, out); break;
        case 16: tile_values<GT, 16>(w, n, values, table, p, s, h, out); break;
        default: tile_values_any<GT>(w, n, values, table, p, s, h, out); break;
      }
    });
  }
}

// Row b's output from its parts' results, merged in order.
template <typename T>
void merge_row(const float* results, int64_t parts, const Shape& s, T* out) {
  const int64_t D = s.head_dim, H = s.heads, width = H * (D + 2);
  std::vector<float> acc(static_cast<size_t>(D));
  for (int64_t qh = 0; qh < H; ++qh) {
    float top = -INFINITY;
    for (int64_t p = 0; p < parts; ++p) top = std::max(top, results[p * width + H * D + qh]);
    float total = 0.0f;
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t p = 0; p < parts; ++p) {
      const float* r = results + p * width;
      const float scale = std::exp(r[H * D + qh] - top);
      total += r[H * D + H + qh] * scale;
      for (int64_t d = 0; d < D; ++d) acc[d] += r[qh * D + d] * scale;
    }
    const float inv = 1.0f / total;
    for (int64_t d = 0; d < D; ++d) acc[d] *= inv;
    at::vec::convert(acc.data(), out + qh * D, D);
  }
}

void check_tables(const at::Tensor& tables, const at::Tensor& lengths, const Shape& s) {
  const int64_t* t = tables.data_ptr<int64_t>();
  const int64_t* len = lengths.data_ptr<int64_t>();
  for (int64_t b = 0; b < s.batch; ++b) {
    TORCH_CHECK(len[b] >= 1 && len[b] <= s.max_blocks * s.block_tokens, "decode_attention: row ", b, " has ",
                len[b], " keys, its table holds ", s.max_blocks * s.block_tokens);
    const int64_t used = (len[b] + s.block_tokens - 1) / s.block_tokens;
    for (int64_t i = 0; i < used; ++i) {
      const int64_t block = t[b * s.max_blocks + i];
      TORCH_CHECK(block >= 0 && block < s.pool_blocks, "decode_attention: row ", b, " block ", i, " is ", block,
                  ", outside the pool's ", s.pool_blocks, " blocks");
    }
  }
}

void check_pools(const at::Tensor& keys, const at::Tensor& values) {
  TORCH_CHECK(keys.dim() == 4 && keys.sizes() == values.sizes() && keys.strides() == values.strides(),
              "decode_attention: keys and values are alike [blocks, block_tokens, kv_heads, head_dim], got ",
              keys.sizes(), " and ", values.sizes());
  TORCH_CHECK(keys.stride(3) == 1 && keys.stride(2) == keys.size(3) && keys.stride(1) == keys.size(2) * keys.size(3) &&
                  keys.stride(0) >= keys.size(1) * keys.stride(1),
              "decode_attention: a block of the pool must be dense, got strides ", keys.strides());
}

Shape shape_of(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& tables) {
  Shape s{q.size(0), q.size(1), keys.size(2), q.size(2), 0, tables.size(1), keys.size(1), keys.size(0),
          keys.stride(0)};
  TORCH_CHECK(keys.size(3) == s.head_dim && s.kv_heads > 0 && s.heads % s.kv_heads == 0, "decode_attention: heads ",
              s.heads, " over kv_heads ", s.kv_heads, ", head_dim ", s.head_dim);
  TORCH_CHECK(s.head_dim % Vec::size() == 0, "decode_attention: head_dim ", s.head_dim, " is not a multiple of ",
              Vec::size());
  s.group = s.heads / s.kv_heads;
  return s;
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& tables,
         const at::Tensor& lengths, float scale, const Shape& s, at::Tensor& out) {
  const int64_t* len = lengths.data_ptr<int64_t>();
  std::vector<Part> parts;
  std::vector<int64_t> first(static_cast<size_t>(s.batch + 1));  // row b's parts: [first[b], first[b + 1])
  for (int64_t b = 0; b < s.batch; ++b) {
    first[b] = static_cast<int64_t>(parts.size());
    for (int64_t start = 0; start < len[b]; start += PART) parts.push_back({b, start, std::min(len[b], start + PART)});
  }
  first[s.batch] = static_cast<int64_t>(parts.size());
  const int64_t width = s.heads * (s.head_dim + 2);
  std::vector<float> results(parts.size() * static_cast<size_t>(width));
  const T* qp = q.data_ptr<T>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  // A part per task: with 2 threads a batch-16 step of the default model at 320 keys per row
  // took 33.9 ms against 40.3 ms on one (benchmarks/engine.py --context 320, 2026-12-05).
  at::parallel_for(0, static_cast<int64_t>(parts.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(static_cast<size_t>(s.heads * s.head_dim)), scores;
    for (int64_t i = begin; i < end; ++i) {
      const Part& p = parts[i];
      at::vec::convert(qp + p.row * s.heads * s.head_dim, qf.data(), s.heads * s.head_dim);
      for (float& x : qf) x *= scale;
      attend_part<T>(qf.data(), keys.data_ptr<T>(), values.data_ptr<T>(), tp + p.row * s.max_blocks, p, s, scores,
                     results.data() + i * width);
    }
  });
  T* op = out.data_ptr<T>();
  for (int64_t b = 0; b < s.batch; ++b) {  // (a few flops per part and head: not worth the threads' wake-up)
    merge_row<T>(results.data() + first[b] * width, first[b + 1] - first[b], s, op + b * s.heads * s.head_dim);
  }
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                            const at::Tensor& tables, const at::Tensor& lengths, double scale) {
  TORCH_CHECK(q.device().is_cpu() && keys.device().is_cpu() && values.device().is_cpu(), "decode_attention: CPU");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "decode_attention: q is a contiguous [batch, heads, head_dim]");
  check_pools(keys, values);
  TORCH_CHECK(q.scalar_type() == keys.scalar_type() && q.scalar_type() == values.scalar_type(),
              "decode_attention: q, keys and values share a dtype");
  TORCH_CHECK(tables.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong && tables.dim() == 2 &&
                  tables.is_contiguous() && lengths.is_contiguous() && lengths.numel() == q.size(0) &&
                  tables.size(0) == q.size(0) && tables.size(1) > 0,
              "decode_attention: tables [batch, max_blocks] and lengths [batch], int64");
  const Shape s = shape_of(q, keys, tables);
  check_tables(tables, lengths, s);
  at::Tensor out = at::empty_like(q);
  dispatch(q.scalar_type(), "decode_attention", [&]<typename scalar_t>() {
    run<scalar_t>(q, keys, values, tables, lengths, static_cast<float>(scale), s, out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(pdserve, m) {
  m.def("decode_attention(Tensor q, Tensor keys, Tensor values, Tensor tables, Tensor lengths, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("decode_attention", &decode_attention); }
