// What the CPU can run, asked at run time: the x86 kernels compile their AVX2/FMA paths into
// one library for every machine of an ISA family (native.py) and refuse where the CPU lacks
// them. One place for the checks the kernels share (dense_linear, dense_gemm, quant_linear).
// native.py's build digest covers this header with the sources, so a change here rebuilds.
#pragma once

namespace pdserve_cpu {

// 8-wide fp32 FMA: the dense fp32 kernels.
inline bool has_avx2_fma() {
#if defined(__x86_64__) && defined(__GNUC__)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

// The same and fp16 conversions (F16C): the quantized blocks' fp16 scales.
inline bool has_avx2_fma_f16c() {
#if defined(__x86_64__) && defined(__GNUC__)
  return has_avx2_fma() && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

}  // namespace pdserve_cpu
