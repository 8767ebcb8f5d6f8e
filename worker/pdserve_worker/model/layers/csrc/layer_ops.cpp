// The elementwise parts of a decoder layer, each one op instead of the 4-8 torch ops it takes
// (model/layers/native.py says why): RMSNorm (with the residual add before it), rotary embedding
// of q and k (with qwen3's per-head q/k norm before it), and SiLU(gate) * up.
//
// Each rounds where HF transformers' modeling code rounds, so a bf16 result is the one torch's
// ops give up to the order of one fp32 sum (RMSNorm's mean of squares):
//   rms_norm:   y = w * T(x * rsqrt(mean(x^2) + eps))           (x, the mean and rsqrt in fp32)
//   add:        x' = T(x + delta)
//   rope:       out = T(T(x * cos) + T(roll(x) * signed_sin))    (cos, sin already in T)
//   silu_mul:   out = T(T(silu(gate)) * up)
// Every op works row by row (a token's row never depends on another's), in a fixed order: a
// row's bits are the same alone or in any batch. Values move BLOCK (two Vectorized<float>) at a
// time, widened from and rounded back to T in registers; a row's tail runs the same steps one
// value at a time.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "rows.h"

#include <cmath>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t BLOCK = 2 * Vec::size();

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

// BLOCK values of T as two fp32 vectors, and back.
template <typename T>
inline void load2(const T* p, Vec& a, Vec& b) {
  if constexpr (std::is_same_v<T, float>) {
    a = Vec::loadu(p);
    b = Vec::loadu(p + Vec::size());
  } else {
    std::tie(a, b) = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(p));
  }
}

template <typename T>
inline void store2(T* p, const Vec& a, const Vec& b) {
  if constexpr (std::is_same_v<T, float>) {
    a.store(p);
    b.store(p + Vec::size());
  } else {
    at::vec::convert_from_float<T>(a, b).store(p);
  }
}

// The values a and b take once stored in T (the rounding a torch op in T does), kept as fp32.
template <typename T>
inline void round2(Vec& a, Vec& b) {
  if constexpr (!std::is_same_v<T, float>) {
    std::tie(a, b) = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(a, b));
  }
}

template <typename T>
inline float round_to(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    return static_cast<float>(static_cast<T>(x));
  }
}

// Rows per parallel task: a few tens of KB of work, so a batch-1 decode step stays on one thread.
inline int64_t grain(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)); }

// 1 / sqrt(mean(x^2) + eps) of one row of T, in a fixed order.
template <typename T>
float inv_rms(const T* x, int64_t n, float eps) {
  Vec acc(0.0f);
  int64_t i = 0;
  for (; i + BLOCK <= n; i += BLOCK) {
    Vec a, b;
    load2(x + i, a, b);
    acc = at::vec::fmadd(a, a, at::vec::fmadd(b, b, acc));
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& u, Vec& v) { return u + v; }, acc);
  for (; i < n; ++i) sum += static_cast<float>(x[i]) * static_cast<float>(x[i]);
  return 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
}

// y = w * T(x * inv) for one row.
template <typename T>
void scale_row(const T* x, const T* w, float inv, int64_t n, T* y) {
  int64_t i = 0;
  const Vec s(inv);
  for (; i + BLOCK <= n; i += BLOCK) {
    Vec a, b, wa, wb;
    load2(x + i, a, b);
    a = a * s;
    b = b * s;
    round2<T>(a, b);
    load2(w + i, wa, wb);
    store2(y + i, wa * a, wb * b);
  }
  for (; i < n; ++i) y[i] = static_cast<T>(static_cast<float>(w[i]) * round_to<T>(static_cast<float>(x[i]) * inv));
}

void check_rows(const at::Tensor& x, const at::Tensor& w, const char* what) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1 && x.is_contiguous(), what, ": x is a contiguous CPU [..., width]");
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.size(0) == x.size(-1) && w.scalar_type() == x.scalar_type(),
              what, ": weight [", x.size(-1), "] in x's dtype, got ", w.sizes(), " ", w.scalar_type());
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, w, "rms_norm");
  at::Tensor y = at::empty_like(x);
  const int64_t n = x.size(-1);
  dispatch(x.scalar_type(), "rms_norm", [&]<typename T>() {
    const T* xp = x.data_ptr<T>();
    const T* wp = w.data_ptr<T>();
    T* yp = y.data_ptr<T>();
    at::parallel_for(0, pdserve_rows::count(x), grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scale_row<T>(xp + r * n, wp, inv_rms<T>(xp + r * n, n, static_cast<float>(eps)), n, yp + r * n);
      }
    });
  });
  return y;
}

// s = T(x + delta) for one row.
template <typename T>
void add_row(const T* x, const T* delta, int64_t n, T* s) {
  int64_t i = 0;
  for (; i + BLOCK <= n; i += BLOCK) {
    Vec a, b, da, db;
    load2(x + i, a, b);
    load2(delta + i, da, db);
    store2(s + i, a + da, b + db);
  }
  for (; i < n; ++i) s[i] = static_cast<T>(static_cast<float>(x[i]) + static_cast<float>(delta[i]));
}

// (x + delta, rms_norm(x + delta)): the residual add of one sublayer and the norm of the next.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& w,
                                                double eps) {
  check_rows(x, w, "add_rms_norm");
  TORCH_CHECK(delta.sizes() == x.sizes() && delta.is_contiguous() && delta.scalar_type() == x.scalar_type(),
              "add_rms_norm: delta like x ", x.sizes(), ", got ", delta.sizes());
  at::Tensor sum = at::empty_like(x);
  at::Tensor y = at::empty_like(x);
  const int64_t n = x.size(-1);
  dispatch(x.scalar_type(), "add_rms_norm", [&]<typename T>() {
    const T* xp = x.data_ptr<T>();
    const T* dp = delta.data_ptr<T>();
    const T* wp = w.data_ptr<T>();
    T* sp = sum.data_ptr<T>();
    T* yp = y.data_ptr<T>();
    at::parallel_for(0, pdserve_rows::count(x), grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        add_row<T>(xp + r * n, dp + r * n, n, sp + r * n);
        scale_row<T>(sp + r * n, wp, inv_rms<T>(sp + r * n, n, static_cast<float>(eps)), n, yp + r * n);
      }
    });
  });
  return {sum, y};
}

// exp_u20: ATen's faster exp (20 ulp), the one torch's own softmax kernels use.
inline Vec silu(const Vec& x) { return x / (Vec(1.0f) + x.neg().exp_u20()); }

// T(T(silu(g)) * u) over one row's n values.
template <typename T>
void silu_mul_row(const T* g, const T* u, T* out, int64_t n) {
  int64_t i = 0;
  for (; i + BLOCK <= n; i += BLOCK) {
    Vec ga, gb, ua, ub;
    load2(g + i, ga, gb);
    load2(u + i, ua, ub);
    Vec a = silu(ga), b = silu(gb);
    round2<T>(a, b);  // silu's result in T, as torch's silu returns it
    store2(out + i, a * ua, b * ub);
  }
  for (; i < n; ++i) {
    const float gf = static_cast<float>(g[i]);
    out[i] = static_cast<T>(round_to<T>(gf / (1.0f + std::exp(-gf))) * static_cast<float>(u[i]));
  }
}

// silu(gate) * up over gate_up [..., 2 * inter] (gate first): [..., inter].
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.dim() >= 1 && gate_up.is_contiguous() && gate_up.size(-1) % 2 == 0,
              "silu_mul: gate_up is a contiguous CPU [..., 2 * inter], got ", gate_up.sizes());
  const int64_t rows = pdserve_rows::count(gate_up), inter = gate_up.size(-1) / 2;
  at::Tensor out = at::empty(pdserve_rows::with_last(gate_up, inter), gate_up.options());
  dispatch(gate_up.scalar_type(), "silu_mul", [&]<typename T>() {
    const T* gp = gate_up.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, rows, grain(inter), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) silu_mul_row<T>(gp + r * 2 * inter, gp + r * 2 * inter + inter, op + r * inter, inter);
    });
  });
  return out;
}

// dst = T(T(src * cos) + T(roll(src, D/2) * signed_sin)) for one head of D values. Where half a
// head is whole blocks (D 64 or 128: every family here) the roll is a swap of blocks.
template <typename T>
void rotate(const T* src, const T* cos, const T* sin, int64_t D, T* dst) {
  const int64_t half = D / 2;
  if (half % BLOCK == 0) {
    for (int64_t i = 0; i < D; i += BLOCK) {
      Vec xa, xb, ra, rb, ca, cb, sa, sb;
      load2(src + i, xa, xb);
      load2(src + (i + half) % D, ra, rb);
      load2(cos + i, ca, cb);
      load2(sin + i, sa, sb);
      Vec pa = xa * ca, pb = xb * cb, qa = ra * sa, qb = rb * sb;
      round2<T>(pa, pb);
      round2<T>(qa, qb);
      store2(dst + i, pa + qa, pb + qb);
    }
    return;
  }
  for (int64_t d = 0; d < D; ++d) {
    const float a = round_to<T>(static_cast<float>(src[d]) * static_cast<float>(cos[d]));
    const float b = round_to<T>(static_cast<float>(src[(d + half) % D]) * static_cast<float>(sin[d]));
    dst[d] = static_cast<T>(a + b);
  }
}

void check_rope(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t kv_heads,
                const std::optional<at::Tensor>& qk_norm) {
  TORCH_CHECK(qkv.device().is_cpu() && qkv.dim() >= 1 && qkv.is_contiguous(), "rope_qkv: qkv is a contiguous CPU [..., width]");
  const int64_t all = heads + 2 * kv_heads;
  TORCH_CHECK(heads > 0 && kv_heads > 0 && qkv.size(-1) % all == 0, "rope_qkv: width ", qkv.size(-1), " is not (",
              heads, " + 2 * ", kv_heads, ") heads of one size");
  const int64_t rows = pdserve_rows::count(qkv), D = qkv.size(-1) / all;
  TORCH_CHECK(D % 2 == 0 && cos.sizes() == sin.sizes() && cos.dim() >= 1 && cos.numel() == rows * D && cos.size(-1) == D &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == qkv.scalar_type() &&
                  sin.scalar_type() == qkv.scalar_type(),
              "rope_qkv: cos and sin of ", rows, " rows of ", D, " in qkv's dtype, got ", cos.sizes());
  if (qk_norm.has_value()) {
    TORCH_CHECK(qk_norm->dim() == 2 && qk_norm->size(0) == heads + kv_heads && qk_norm->size(1) == D &&
                    qk_norm->is_contiguous() && qk_norm->scalar_type() == qkv.scalar_type(),
                "rope_qkv: qk_norm [", heads + kv_heads, ", ", D, "], got ", qk_norm->sizes());
  }
}

// q, k, v of qkv [..., (heads + 2 kv_heads) * D] (after its bias), q and k rotated by cos/sin
// (a row of D each per row of qkv, any leading shape: the model's [B, T, 1, D]; after qwen3's
// per-head norm when qk_norm [heads + kv_heads, D] is given): three contiguous
// [..., heads|kv_heads, D] (qkv's leading shape).
std::tuple<at::Tensor, at::Tensor, at::Tensor> rope_qkv(const at::Tensor& qkv, const at::Tensor& cos,
                                                        const at::Tensor& sin, int64_t heads, int64_t kv_heads,
                                                        const std::optional<at::Tensor>& qk_norm, double eps) {
  check_rope(qkv, cos, sin, heads, kv_heads, qk_norm);
  const int64_t rows = pdserve_rows::count(qkv), all = heads + 2 * kv_heads, D = qkv.size(-1) / all;
  at::Tensor q = at::empty(pdserve_rows::with_last(qkv, heads, D), qkv.options());
  at::Tensor k = at::empty(pdserve_rows::with_last(qkv, kv_heads, D), qkv.options());
  at::Tensor v = at::empty(pdserve_rows::with_last(qkv, kv_heads, D), qkv.options());
  dispatch(qkv.scalar_type(), "rope_qkv", [&]<typename T>() {
    const T* src = qkv.data_ptr<T>();
    const T* cp = cos.data_ptr<T>();
    const T* sp = sin.data_ptr<T>();
    const T* np = qk_norm.has_value() ? qk_norm->data_ptr<T>() : nullptr;
    T* qp = q.data_ptr<T>();
    T* kp = k.data_ptr<T>();
    T* vp = v.data_ptr<T>();
    at::parallel_for(0, rows, grain(all * D), [&](int64_t begin, int64_t end) {
      std::vector<T> normed(static_cast<size_t>(D));
      for (int64_t r = begin; r < end; ++r) {
        const T* row = src + r * all * D;
        for (int64_t h = 0; h < heads + kv_heads; ++h) {
          T* dst = h < heads ? qp + (r * heads + h) * D : kp + (r * kv_heads + h - heads) * D;
          const T* head = row + h * D;
          if (np != nullptr) {  // qwen3: RMSNorm over the head's D, before RoPE
            scale_row<T>(head, np + h * D, inv_rms<T>(head, D, static_cast<float>(eps)), D, normed.data());
            head = normed.data();
          }
          rotate<T>(head, cp + r * D, sp + r * D, D, dst);
        }
        std::copy(row + (heads + kv_heads) * D, row + all * D, vp + r * kv_heads * D);
      }
    });
  });
  return {q, k, v};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor w, float eps) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def(
      "rope_qkv(Tensor qkv, Tensor cos, Tensor sin, int heads, int kv_heads, Tensor? qk_norm, float eps) -> "
      "(Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rope_qkv", &rope_qkv);
}
