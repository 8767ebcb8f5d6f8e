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
// row's bits are the same alone or in any batch.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>
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

// The value fp32 x takes once stored in T (the rounding a torch op in T does).
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

template <typename T>
float mean_square(const float* x, int64_t n) {
  Vec acc(0.0f);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    const Vec v = Vec::loadu(x + i);
    acc = at::vec::fmadd(v, v, acc);
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
  for (; i < n; ++i) sum += x[i] * x[i];
  return sum / static_cast<float>(n);
}

// y = w * T(x * rsqrt(mean(x^2) + eps)) for one row held as fp32 in `row`.
template <typename T>
void norm_row(const float* row, const T* w, float eps, int64_t n, T* y) {
  const float inv = 1.0f / std::sqrt(mean_square<T>(row, n) + eps);
  for (int64_t i = 0; i < n; ++i) {
    y[i] = static_cast<T>(static_cast<float>(w[i]) * round_to<T>(row[i] * inv));
  }
}

void check_rows(const at::Tensor& x, const at::Tensor& w, const char* what) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), what, ": x is a contiguous CPU [rows, width]");
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.size(0) == x.size(1) && w.scalar_type() == x.scalar_type(),
              what, ": weight [", x.size(1), "] in x's dtype, got ", w.sizes(), " ", w.scalar_type());
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, w, "rms_norm");
  at::Tensor y = at::empty_like(x);
  const int64_t n = x.size(1);
  dispatch(x.scalar_type(), "rms_norm", [&]<typename scalar_t>() {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, x.size(0), grain(n), [&](int64_t begin, int64_t end) {
      std::vector<float> row(static_cast<size_t>(n));
      for (int64_t r = begin; r < end; ++r) {
        at::vec::convert(xp + r * n, row.data(), n);
        norm_row<scalar_t>(row.data(), wp, static_cast<float>(eps), n, yp + r * n);
      }
    });
  });
  return y;
}

// (x + delta, rms_norm(x + delta)): the residual add of one sublayer and the norm of the next.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& w,
                                                double eps) {
  check_rows(x, w, "add_rms_norm");
  TORCH_CHECK(delta.sizes() == x.sizes() && delta.is_contiguous() && delta.scalar_type() == x.scalar_type(),
              "add_rms_norm: delta like x ", x.sizes(), ", got ", delta.sizes());
  at::Tensor sum = at::empty_like(x);
  at::Tensor y = at::empty_like(x);
  const int64_t n = x.size(1);
  dispatch(x.scalar_type(), "add_rms_norm", [&]<typename scalar_t>() {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* dp = delta.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* sp = sum.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, x.size(0), grain(n), [&](int64_t begin, int64_t end) {
      std::vector<float> row(static_cast<size_t>(n));
      for (int64_t r = begin; r < end; ++r) {
        for (int64_t i = 0; i < n; ++i) {
          const scalar_t s = static_cast<scalar_t>(static_cast<float>(xp[r * n + i]) + static_cast<float>(dp[r * n + i]));
          sp[r * n + i] = s;
          row[i] = static_cast<float>(s);
        }
        norm_row<scalar_t>(row.data(), wp, static_cast<float>(eps), n, yp + r * n);
      }
    });
  });
  return {sum, y};
}

// silu(gate) * up of one row's `n` values, Vec::size() at a time (exp is ATen's vectorized one).
template <typename T>
void silu_mul_row(const T* g, const T* u, T* out, int64_t n) {
  constexpr int64_t W = Vec::size();
  float gf[W], uf[W], act[W];
  T rounded[W];
  for (int64_t i = 0; i < n; i += W) {
    const int64_t m = std::min(W, n - i);
    at::vec::convert(g + i, gf, m);
    at::vec::convert(u + i, uf, m);
    const Vec x = Vec::loadu(gf, m);
    (x / (Vec(1.0f) + x.neg().exp())).store(act, m);
    at::vec::convert(act, rounded, m);  // silu's result in T, as torch's silu returns it
    at::vec::convert(rounded, act, m);
    (Vec::loadu(act, m) * Vec::loadu(uf, m)).store(act, m);
    at::vec::convert(act, out + i, m);
  }
}

// silu(gate) * up over gate_up [rows, 2 * inter] (gate first): [rows, inter].
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up is a contiguous CPU [rows, 2 * inter], got ", gate_up.sizes());
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, inter}, gate_up.options());
  dispatch(gate_up.scalar_type(), "silu_mul", [&]<typename scalar_t>() {
    const scalar_t* gp = gate_up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain(inter), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        silu_mul_row<scalar_t>(gp + r * 2 * inter, gp + r * 2 * inter + inter, op + r * inter, inter);
      }
    });
  });
  return out;
}

// One head's row x [D] rotated in place: T(T(x * cos) + T(roll(x, D/2) * signed_sin)).
template <typename T>
inline void rotate(T* x, const T* cos, const T* sin, int64_t D, float* tmp) {
  for (int64_t d = 0; d < D; ++d) tmp[d] = static_cast<float>(x[d]);
  const int64_t half = D / 2;
  for (int64_t d = 0; d < D; ++d) {
    const float rolled = tmp[(d + half) % D];
    const float a = round_to<T>(tmp[d] * static_cast<float>(cos[d]));
    const float b = round_to<T>(rolled * static_cast<float>(sin[d]));
    x[d] = static_cast<T>(a + b);
  }
}

// q, k, v of qkv [rows, (heads + 2 kv_heads) * D] (after its bias), q and k rotated by cos/sin
// [rows, D] (after qwen3's per-head norm when qk_norm [heads + kv_heads, D] is given): three
// contiguous [rows, heads|kv_heads, D].
std::tuple<at::Tensor, at::Tensor, at::Tensor> rope_qkv(const at::Tensor& qkv, const at::Tensor& cos,
                                                        const at::Tensor& sin, int64_t heads, int64_t kv_heads,
                                                        const std::optional<at::Tensor>& qk_norm, double eps) {
  TORCH_CHECK(qkv.device().is_cpu() && qkv.dim() == 2 && qkv.is_contiguous(), "rope_qkv: qkv is a contiguous CPU [rows, width]");
  const int64_t rows = qkv.size(0), all = heads + 2 * kv_heads;
  TORCH_CHECK(heads > 0 && kv_heads > 0 && qkv.size(1) % all == 0, "rope_qkv: width ", qkv.size(1), " is not (",
              heads, " + 2 * ", kv_heads, ") heads of one size");
  const int64_t D = qkv.size(1) / all;
  TORCH_CHECK(D % 2 == 0 && cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == rows && cos.size(1) == D &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == qkv.scalar_type() &&
                  sin.scalar_type() == qkv.scalar_type(),
              "rope_qkv: cos and sin [", rows, ", ", D, "] in qkv's dtype, got ", cos.sizes());
  if (qk_norm.has_value()) {
    TORCH_CHECK(qk_norm->dim() == 2 && qk_norm->size(0) == heads + kv_heads && qk_norm->size(1) == D &&
                    qk_norm->is_contiguous() && qk_norm->scalar_type() == qkv.scalar_type(),
                "rope_qkv: qk_norm [", heads + kv_heads, ", ", D, "], got ", qk_norm->sizes());
  }
  at::Tensor q = at::empty({rows, heads, D}, qkv.options());
  at::Tensor k = at::empty({rows, kv_heads, D}, qkv.options());
  at::Tensor v = at::empty({rows, kv_heads, D}, qkv.options());
  dispatch(qkv.scalar_type(), "rope_qkv", [&]<typename scalar_t>() {
    const scalar_t* src = qkv.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    const scalar_t* np = qk_norm.has_value() ? qk_norm->data_ptr<scalar_t>() : nullptr;
    scalar_t* outs[2] = {q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>()};
    scalar_t* vp = v.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain(all * D), [&](int64_t begin, int64_t end) {
      std::vector<float> tmp(static_cast<size_t>(D));
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* row = src + r * all * D;
        for (int64_t h = 0; h < heads + kv_heads; ++h) {
          const bool is_q = h < heads;
          scalar_t* dst = outs[is_q ? 0 : 1] + (r * (is_q ? heads : kv_heads) + (is_q ? h : h - heads)) * D;
          if (np != nullptr) {  // qwen3: RMSNorm over the head's D, before RoPE
            for (int64_t d = 0; d < D; ++d) tmp[d] = static_cast<float>(row[h * D + d]);
            norm_row<scalar_t>(tmp.data(), np + h * D, static_cast<float>(eps), D, dst);
          } else {
            std::copy(row + h * D, row + (h + 1) * D, dst);
          }
          rotate<scalar_t>(dst, cp + r * D, sp + r * D, D, tmp.data());
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
