// Small AVX2 pieces the fp32 kernels share (dense_linear, dense_gemm, prefill_attention_fp32):
// one copy, so a kernel that widens bf16 or sums lanes does it the same way as the others.
// x86 only; compiled for AVX2/FMA whatever the file's flags, as the kernels' own regions are
// (they refuse at run time where the CPU lacks it: cpu_features.h). native.py's build digest
// covers this header with the sources, so a change here rebuilds.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#pragma GCC push_options
#pragma GCC target("avx2,fma")

namespace pdserve_avx2 {

// A weight as fp32: itself, or (bf16, held as its bits) the same bits in the high half (exact).
inline float widen(float v) { return v; }
inline float widen(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// 8 values as fp32: loaded, or (bf16, held as their bits) widened by a shift into the high half.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

// The 8 lanes added in a fixed tree (halves, then pairs, then the last two): the same bits
// wherever it is called.
inline float lane_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace pdserve_avx2

#pragma GCC pop_options
#endif  // __x86_64__
