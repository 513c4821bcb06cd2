// The row helpers the kernels of decode_ops.cpp and decode_attention.cpp share: element loads and stores in fp32,
// the activation and KV pool dtype dispatch, and their argument checks.
#pragma once

#include <ATen/ATen.h>

#include "simd.h"

#include <cstdint>
#include <cstring>
#include <vector>

namespace cpuserve_rows {

constexpr float kInt8Max = 127.0f;
constexpr float kMinScale = 1e-30f;  // engine/layers/kv_quant.py: an all-zero row divides 0 by a tiny number

inline float load(float x) { return x; }
inline float load(int8_t x) { return static_cast<float>(x); }
inline float load(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = load(src[i]);
}

template <typename T>
inline T store(float x) { return static_cast<T>(x); }  // BFloat16's constructor rounds to nearest even

inline float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

#if defined(__AVX512F__)
using cpuserve_simd::load16;  // 16 elements as fp32 lanes
#endif

inline void check_cpu_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// Calls fn(T{}) with T the activation type: float32 or bfloat16 (the engine's two activation dtypes).
template <typename Fn>
inline void dispatch_act(at::ScalarType dtype, const char* name, Fn&& fn) {
  switch (dtype) {
    case at::kFloat: fn(float{}); break;
    case at::kBFloat16: fn(at::BFloat16{}); break;
    default: TORCH_CHECK(false, name, ": activations must be float32 or bfloat16, got ", dtype);
  }
}

// Calls fn(ptr) with the pool's data pointer typed as int8, bfloat16 or float32.
template <typename Fn>
inline void dispatch_cache(at::Tensor& pool, Fn&& fn) {
  switch (pool.scalar_type()) {
    case at::kChar: fn(pool.data_ptr<int8_t>()); break;
    case at::kBFloat16: fn(pool.data_ptr<at::BFloat16>()); break;
    case at::kFloat: fn(pool.data_ptr<float>()); break;
    default: TORCH_CHECK(false, "kv pool dtype ", pool.scalar_type(), " is not int8, bfloat16 or float32");
  }
}

// out: contiguous, q's dtype, the given sizes (a replica group's shared-memory slot, written in place)
inline void check_out(const at::Tensor& out, const at::Tensor& like, at::IntArrayRef sizes) {
  TORCH_CHECK(out.device().is_cpu() && out.is_contiguous() && out.scalar_type() == like.scalar_type() &&
                  out.sizes() == sizes,
              "out must be a contiguous CPU ", like.scalar_type(), " tensor of sizes ", sizes, ", got ",
              out.scalar_type(), " ", out.sizes(), out.is_contiguous() ? "" : " (not contiguous)");
}

}  // namespace cpuserve_rows
