// Fused CPU kernels for the decode hot path, registered as torch.ops.cpuserve.*.
//
// Eager PyTorch spends most of a batch-1 decode step dispatching ~40 small ops per layer (RMSNorm's composite,
// RoPE's slices and cats, the KV quantize-and-scatter; decode attention has its own file). Each op here
// replaces one such chain with one pass over the data. Numerics follow the plain-torch path in
// engine/layers: fp32 arithmetic, one rounding to the activation dtype at the end.
//
// Built on first use by engine/layers/native.py (torch.utils.cpp_extension, -O3 -march=native).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"
#include "rows.h"
#include "simd.h"
#include "tasks.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using namespace cpuserve_rows;

// ---- RoPE on q and k, then the new tokens' K and V into the pool ---------------------------------------------
//
// qkv [N, H + 2 * Hkv, D] in place: heads 0..H+Hkv-1 rotated (rotate_half layout) with cos/sin [N, D]. Then
// rows H..H+2Hkv-1 (K heads, V heads) go to pool slot slot_mapping[n]: quantized per (token, head) to int8 with
// scale absmax / 127 (round half to even), or cast for bf16/fp32 pools.
// One head's row r [D] rotated in place by the row's c, s [D] (x: scratch [D])
template <typename act_t>
inline void rope_row(act_t* r, const float* c, const float* s, float* x, int64_t D) {
  const int64_t half = D / 2;
#if defined(__AVX512F__)
  if (half % 16 == 0) {  // the scalar loop's arithmetic, 16 lanes at a time
    for (int64_t i = 0; i < half; i += 16) {
      const __m512 lo = load16(r + i), hi = load16(r + i + half);
      const __m512 a = _mm512_sub_ps(_mm512_mul_ps(lo, _mm512_loadu_ps(c + i)),
                                     _mm512_mul_ps(hi, _mm512_loadu_ps(s + i)));
      const __m512 b = _mm512_add_ps(_mm512_mul_ps(hi, _mm512_loadu_ps(c + i + half)),
                                     _mm512_mul_ps(lo, _mm512_loadu_ps(s + i + half)));
      cpuserve_simd::store16(r + i, a);
      cpuserve_simd::store16(r + i + half, b);
    }
    return;
  }
#endif
  load_row(r, x, D);
  for (int64_t i = 0; i < half; ++i) {
    r[i] = store<act_t>(x[i] * c[i] - x[i + half] * s[i]);
    r[i + half] = store<act_t>(x[i + half] * c[i + half] + x[i] * s[i + half]);
  }
}

// x [D] -> dst int8 with *scale = absmax / 127, as the scalar path below and kv_quant.py's writer do (division,
// round half to even, clamp); false where D is not a multiple of 16 (the caller's scalar loop runs)
inline bool quantize_row_int8(const float* x, int64_t D, int8_t* dst, float* scale) {
#if defined(__AVX512F__)
  if (D % 16 != 0) return false;
  __m512 amax = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(x + d)));
  const float sc = std::max(_mm512_reduce_max_ps(amax) / kInt8Max, kMinScale);
  const __m512 vsc = _mm512_set1_ps(sc), hi = _mm512_set1_ps(kInt8Max), lo = _mm512_set1_ps(-kInt8Max);
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 q = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + d), vsc),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i i32 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(q, lo), hi));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + d), _mm512_cvtepi32_epi8(i32));
  }
  *scale = sc;
  return true;
#else
  return false;
#endif
}

template <typename act_t, typename cache_t>
void rope_write_kv_kernel(act_t* qkv, const act_t* cos, const act_t* sin, cache_t* pool, float* pool_scale,
                          const int64_t* slots, int64_t N, int64_t H, int64_t Hkv, int64_t D) {
  const int64_t heads = H + 2 * Hkv;
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> c(D), s(D), x(D);
    for (int64_t n = begin; n < end; ++n) {
      load_row(cos + n * D, c.data(), D);
      load_row(sin + n * D, s.data(), D);
      for (int64_t h = 0; h < H + Hkv; ++h) rope_row(qkv + (n * heads + h) * D, c.data(), s.data(), x.data(), D);
      const int64_t slot = slots[n];
      for (int64_t j = 0; j < 2 * Hkv; ++j) {
        load_row(qkv + (n * heads + H + j) * D, x.data(), D);
        cache_t* dst = pool + (slot * 2 * Hkv + j) * D;
        if constexpr (std::is_same_v<cache_t, int8_t>) {
          if (quantize_row_int8(x.data(), D, dst, pool_scale + slot * 2 * Hkv + j)) continue;
          float amax = 0.f;
          for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
          const float sc = std::max(amax / kInt8Max, kMinScale);
          for (int64_t d = 0; d < D; ++d)
            dst[d] = static_cast<int8_t>(std::clamp(std::nearbyint(x[d] / sc), -kInt8Max, kInt8Max));
          pool_scale[slot * 2 * Hkv + j] = sc;
        } else {
          for (int64_t d = 0; d < D; ++d) dst[d] = store<cache_t>(x[d]);
        }
      }
    }
  });
}

void rope_write_kv(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t n_heads,
                   at::Tensor& pool, c10::optional<at::Tensor> pool_scale, const at::Tensor& slot_mapping) {
  check_cpu_contiguous(qkv, "qkv");
  check_cpu_contiguous(cos, "cos");
  check_cpu_contiguous(sin, "sin");
  check_cpu_contiguous(pool, "pool");
  check_cpu_contiguous(slot_mapping, "slot_mapping");
  const int64_t N = qkv.size(0), D = qkv.size(2), Hkv = pool.size(2) / 2;
  TORCH_CHECK(qkv.size(1) == n_heads + 2 * Hkv, "qkv has ", qkv.size(1), " heads, expected n_heads + 2 * Hkv = ",
              n_heads + 2 * Hkv);
  TORCH_CHECK(cos.numel() == N * D && sin.numel() == N * D, "cos and sin must hold [N, D]");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(),
              "cos and sin must have qkv's dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == N, "slot_mapping must be int64 [N]");
  float* sp = nullptr;
  if (pool.scalar_type() == at::kChar) {
    TORCH_CHECK(pool_scale.has_value() && pool_scale->scalar_type() == at::kFloat, "an int8 pool needs fp32 scales");
    check_cpu_contiguous(*pool_scale, "pool_scale");
    sp = pool_scale->data_ptr<float>();
  }
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  dispatch_act(qkv.scalar_type(), "rope_write_kv", [&](auto act) {
    using act_t = decltype(act);
    dispatch_cache(pool, [&](auto* cache) {
      rope_write_kv_kernel(qkv.data_ptr<act_t>(), cos.data_ptr<act_t>(), sin.data_ptr<act_t>(), cache, sp, slots, N,
                           n_heads, Hkv, D);
    });
  });
}

// ---- RMSNorm and SiLU(gate) * up --------------------------------------------------------------------------------
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_cpu_contiguous(x, "x");
  check_cpu_contiguous(weight, "weight");
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  TORCH_CHECK(weight.numel() == dim && weight.scalar_type() == x.scalar_type(), "weight must be [dim] in x's dtype");
  auto out = at::empty_like(x);
  dispatch_act(x.scalar_type(), "rms_norm", [&](auto act) {
    using scalar_t = decltype(act);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> r(dim), w(dim);
      load_row(wp, w.data(), dim);
      for (int64_t i = begin; i < end; ++i) {
        load_row(xp + i * dim, r.data(), dim);
        const float inv = 1.f / std::sqrt(dot(r.data(), r.data(), dim) / dim + static_cast<float>(eps));
        for (int64_t d = 0; d < dim; ++d) op[i * dim + d] = store<scalar_t>(r[d] * inv * w[d]);
      }
    });
  });
  return out;
}

// The residual add and the next RMSNorm in one pass: h = x + delta (rounded to x's dtype element by element, as
// torch's add), out = rms_norm(h, weight) (rms_norm's arithmetic above, read back from h)
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                                                double eps) {
  check_cpu_contiguous(x, "x");
  check_cpu_contiguous(delta, "delta");
  check_cpu_contiguous(weight, "weight");
  TORCH_CHECK(delta.sizes() == x.sizes() && delta.scalar_type() == x.scalar_type(),
              "delta must have x's shape and dtype: x ", x.scalar_type(), " ", x.sizes(), ", delta ",
              delta.scalar_type(), " ", delta.sizes());
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  TORCH_CHECK(weight.numel() == dim && weight.scalar_type() == x.scalar_type(), "weight must be [dim] in x's dtype");
  auto h = at::empty_like(x), out = at::empty_like(x);
  dispatch_act(x.scalar_type(), "add_rms_norm", [&](auto act) {
    using scalar_t = decltype(act);
    const scalar_t *xp = x.data_ptr<scalar_t>(), *dp = delta.data_ptr<scalar_t>(), *wp = weight.data_ptr<scalar_t>();
    scalar_t *hp = h.data_ptr<scalar_t>(), *op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> r(dim), w(dim);
      load_row(wp, w.data(), dim);
      for (int64_t i = begin; i < end; ++i) {
        for (int64_t d = 0; d < dim; ++d) hp[i * dim + d] = store<scalar_t>(load(xp[i * dim + d]) + load(dp[i * dim + d]));
        load_row(hp + i * dim, r.data(), dim);
        const float inv = 1.f / std::sqrt(dot(r.data(), r.data(), dim) / dim + static_cast<float>(eps));
        for (int64_t d = 0; d < dim; ++d) op[i * dim + d] = store<scalar_t>(r[d] * inv * w[d]);
      }
    });
  });
  return {h, out};
}

// [.., 2 * inner] -> [.., inner]
std::vector<int64_t> silu_mul_sizes(const at::Tensor& gate_up) {
  auto sizes = gate_up.sizes().vec();
  sizes.back() /= 2;
  return sizes;
}

at::Tensor& silu_mul_out(const at::Tensor& gate_up, at::Tensor& out) {
  check_cpu_contiguous(gate_up, "gate_up");
  const int64_t width = gate_up.size(-1), inner = width / 2, rows = gate_up.numel() / width;
  check_out(out, gate_up, silu_mul_sizes(gate_up));
  dispatch_act(gate_up.scalar_type(), "silu_mul", [&](auto act) {
    using scalar_t = decltype(act);
    const scalar_t* in = gate_up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const scalar_t *a = in + i * width, *b = a + inner;
        scalar_t* o = op + i * inner;
        int64_t d = 0;
#if defined(__AVX512F__)
        for (; d + 16 <= inner; d += 16) {  // a / (1 + e^-a) * b, 16 lanes at a time, loaded and stored as such
          const __m512 x = load16(a + d);
          const __m512 e = cpuserve_simd::exp512(_mm512_sub_ps(_mm512_setzero_ps(), x));
          const __m512 silu = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e));
          cpuserve_simd::store16(o + d, _mm512_mul_ps(silu, load16(b + d)));
        }
#endif
        for (; d < inner; ++d) {
          const float x = load(a[d]);
          o[d] = store<scalar_t>(x / (1.f + std::exp(-x)) * load(b[d]));
        }
      }
    });
  });
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  auto out = at::empty(silu_mul_sizes(gate_up), gate_up.options());
  return silu_mul_out(gate_up, out);
}

}  // namespace

namespace cpuserve_ops {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) { return ::rms_norm(x, weight, eps); }
at::Tensor& silu_mul_out(const at::Tensor& gate_up, at::Tensor& out) { return ::silu_mul_out(gate_up, out); }
void rope_write_kv(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t n_heads, at::Tensor& pool,
                   c10::optional<at::Tensor> pool_scale, const at::Tensor& slot_mapping) {
  ::rope_write_kv(qkv, cos, sin, n_heads, pool, std::move(pool_scale), slot_mapping);
}

}  // namespace cpuserve_ops

TORCH_LIBRARY(cpuserve, m) {
  m.def("rope_write_kv(Tensor(a!) qkv, Tensor cos, Tensor sin, int n_heads, Tensor(b!) pool, Tensor(c!)? pool_scale, "
        "Tensor slot_mapping) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("silu_mul.out(Tensor gate_up, *, Tensor(a!) out) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(cpuserve, CPU, m) {
  m.impl("rope_write_kv", &rope_write_kv);
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("silu_mul.out", &silu_mul_out);
}
