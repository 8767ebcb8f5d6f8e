// The ops' view of their inputs: a tensor of any leading shape is rows of its last dimension
// (rows = the product of the leading sizes), and a result keeps the input's leading shape. So the model calls them
// on its [batch, tokens, width] activations as they are: a Python reshape before and a view after
// each call cost more than the op itself at a decode step's one row (~6 us against ~3,
// 2026-12-06, 2-vCPU Zen 3), ~12 of them a layer. native.py's build digest covers this header.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace pdserve_rows {

// Rows of x's last dimension: the product of the leading sizes (also where the width is 0).
inline int64_t count(const at::Tensor& x) {
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) rows *= x.size(d);
  return rows;
}

// x's shape with the last dimension `last` (x has at least one dimension).
inline std::vector<int64_t> with_last(const at::Tensor& x, int64_t last) {
  std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end());
  sizes.back() = last;
  return sizes;
}

// x's shape, its last dimension replaced by two, [a, b] (e.g. [heads, head_dim]).
inline std::vector<int64_t> with_last(const at::Tensor& x, int64_t a, int64_t b) {
  std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end() - 1);
  sizes.push_back(a);
  sizes.push_back(b);
  return sizes;
}

}  // namespace pdserve_rows
