// The vector steps of dense_gemm.cpp: how one output element's dot product over K advances, per level.
//
// A step takes kStep inputs of one activation row and one weight row and adds their products into one accumulator
// of fp32 lanes (each lane sums the inputs k = lane (mod lanes) in increasing k); at the end the lanes are summed in
// a fixed tree. Every output element runs the same steps on its own accumulator, whatever the rows and columns
// around it, so its bits depend on its row of x, its row of W and K alone.
//
//     level         fp32 weights                   bf16 weights
//     avx512_bf16   16 lanes, fma                  16 lanes, vdpbf16ps: 32 inputs a step, pairs (2i, 2i+1)
//     avx512_vnni   16 lanes, fma                  16 lanes, bf16 widened to fp32 (exact), fma
//     avx2*         8 lanes, fma                   8 lanes, widened, fma
//
// The inputs past the last whole step are read masked (zeros in both operands add +0). The levels round unlike
// each other (their lanes differ); within one, a row's bits never depend on its batch.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#define CPUSERVE_DENSE_GEMM 1
#endif

#if defined(CPUSERVE_DENSE_GEMM)
namespace cpuserve_dense {

using bf16 = c10::BFloat16;

#if defined(__AVX512F__)
using Acc = __m512;
constexpr int kLanes = 16;
inline Acc zero() { return _mm512_setzero_ps(); }
inline Acc fma(Acc a, Acc b, Acc acc) { return _mm512_fmadd_ps(a, b, acc); }
inline float sum(Acc acc) { return _mm512_reduce_add_ps(acc); }
inline __mmask16 mask16(int64_t n) { return static_cast<__mmask16>((1u << n) - 1); }  // n < 16

// lanes of fp32 from 16 floats or 16 bf16 (widened exactly); n < 16: the first n, zeros after
inline Acc lanes(const float* p) { return _mm512_loadu_ps(p); }
inline Acc lanes(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(mask16(n), p); }
inline Acc widen(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
inline Acc lanes(const bf16* p) { return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline Acc lanes(const bf16* p, int64_t n) { return widen(_mm256_maskz_loadu_epi16(mask16(n), p)); }
#else
using Acc = __m256;
constexpr int kLanes = 8;
inline Acc zero() { return _mm256_setzero_ps(); }
inline Acc fma(Acc a, Acc b, Acc acc) { return _mm256_fmadd_ps(a, b, acc); }
inline float sum(Acc acc) {  // lanes (i, i + 4), then (i, i + 2), then (0, 1)
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline Acc lanes(const float* p) { return _mm256_loadu_ps(p); }
inline Acc lanes(const float* p, int64_t n) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), idx));
}
inline Acc widen(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
inline Acc lanes(const bf16* p) { return widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline Acc lanes(const bf16* p, int64_t n) {
  uint16_t part[8] = {};
  std::memcpy(part, p, n * sizeof(bf16));
  return widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(part)));
}
#endif

// Each input widened to fp32 lanes, then fma: fp32 weights everywhere, bf16 weights without AVX512-BF16
template <typename T>
struct WidenStep {
  using In = Acc;  // one row's operand of a step
  static constexpr int kStep = kLanes;
  static In load(const T* p) { return lanes(p); }
  static In load(const T* p, int64_t n) { return lanes(p, n); }
  static Acc mac(In a, In w, Acc acc) { return fma(a, w, acc); }
};

#if defined(__AVX512BF16__)
// vdpbf16ps: lane i adds a[2i] * w[2i] and a[2i + 1] * w[2i + 1] (bf16 products are exact in fp32)
struct DotBf16Step {
  using In = __m512i;
  static constexpr int kStep = 32;
  static In load(const bf16* p) { return _mm512_loadu_si512(p); }
  static In load(const bf16* p, int64_t n) { return _mm512_maskz_loadu_epi16(static_cast<__mmask32>((1ull << n) - 1), p); }
  static Acc mac(In a, In w, Acc acc) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)w); }
};
#endif

template <typename T>
struct StepOf { using type = WidenStep<T>; };
#if defined(__AVX512BF16__)
template <>
struct StepOf<bf16> { using type = DotBf16Step; };
#endif

inline const char* isa() {
#if defined(__AVX512BF16__)
  return "avx512_bf16";
#elif defined(__AVX512F__)
  return "avx512";
#else
  return "avx2";
#endif
}

}  // namespace cpuserve_dense
#endif
