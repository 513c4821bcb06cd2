// One sequence's context read back from a layer's int8 KV pool for prefill attention, in one pass over the block
// table: K and V dequantized to bf16 (gather_kv_int8), or K's codes and scales as stored with V dequantized
// (gather_context_int8, for Q K^T in int8).
//
// The plain-torch path (engine/layers/kv_quant.py gather_kv) takes four ops for K and four for V: index_select of
// the blocks, a copy to fp32, the multiply by the scales, a copy back to bf16. Here each (token, head) row is read
// once and written once: out[t][h][d] = bf16(float(code) * scale[t][h]), the reference's fp32 multiply and
// round-half-to-even, so the two give the same bits.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "rows.h"

#include <cstdint>
#include <cstring>
#include <tuple>

namespace {

using bf16 = at::BFloat16;
using cpuserve_rows::load;
using cpuserve_rows::store;
constexpr int64_t kTokensPerTask = 64;

// The checked block ids of a sequence's first `length` tokens: kv [num_blocks, B, 2 * Hkv, D] int8 (K heads, then V
// heads) with contiguous rows, scale [num_blocks, B, 2 * Hkv] fp32 (any strides), block_table [>= ceil(length / B)]
// int32 or int64
at::Tensor block_ids(const at::Tensor& kv, const at::Tensor& scale, const at::Tensor& block_table, int64_t length) {
  TORCH_CHECK(kv.scalar_type() == at::kChar && kv.dim() == 4 && kv.size(2) % 2 == 0 && kv.stride(3) == 1,
              "kv must be int8 [num_blocks, B, 2 * Hkv, D] with contiguous rows, got ", kv.scalar_type(), " ",
              kv.sizes(), " strides ", kv.strides());
  const int64_t num_blocks = kv.size(0), B = kv.size(1), heads = kv.size(2);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.sizes() == at::IntArrayRef({num_blocks, B, heads}),
              "scale must be fp32 [", num_blocks, ", ", B, ", ", heads, "], got ", scale.scalar_type(), " ",
              scale.sizes());
  const int64_t used = (length + B - 1) / B;
  TORCH_CHECK(length >= 0 && block_table.dim() == 1 && block_table.size(0) >= used,
              "block_table must hold at least ceil(length / B) = ", used, " blocks, got ", block_table.sizes());
  at::Tensor ids = block_table.slice(0, 0, used).to(at::kLong).contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < used; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < num_blocks, "block_table[", i, "] = ", id[i], " is not a block of the pool (",
                num_blocks, ")");
  return ids;
}

// dst[0, D) = bf16(float(row[d]) * s), the reference's fp32 multiply and round-half-to-even
inline void dequantize_row(const int8_t* row, float s, int64_t D, bf16* o) {
  int64_t d = 0;
#if defined(__AVX512F__)
  for (; d + 16 <= D; d += 16)
    cpuserve_simd::store16(o + d, _mm512_mul_ps(cpuserve_simd::load16(row + d), _mm512_set1_ps(s)));
#endif
  for (; d < D; ++d) o[d] = store<bf16>(load(row[d]) * s);
}

// The pool's arguments as block_ids takes them -> K and V, each [length, Hkv, D] bf16
std::tuple<at::Tensor, at::Tensor> gather_kv_int8(const at::Tensor& kv, const at::Tensor& scale,
                                                  const at::Tensor& block_table, int64_t length) {
  const at::Tensor ids = block_ids(kv, scale, block_table, length);
  const int64_t B = kv.size(1), heads = kv.size(2), Hkv = heads / 2, D = kv.size(3);
  const int64_t* id = ids.data_ptr<int64_t>();
  auto k = at::empty({length, Hkv, D}, kv.options().dtype(at::kBFloat16));
  auto v = at::empty_like(k);
  const int8_t* codes = kv.data_ptr<int8_t>();
  const float* scales = scale.data_ptr<float>();
  bf16* const dst[2] = {k.data_ptr<bf16>(), v.data_ptr<bf16>()};
  at::parallel_for(0, length, kTokensPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t block = id[t / B], offset = t % B;
      for (int64_t h = 0; h < heads; ++h) {  // K heads 0 .. Hkv - 1, then V heads
        const int8_t* row = codes + block * kv.stride(0) + offset * kv.stride(1) + h * kv.stride(2);
        const float s = scales[block * scale.stride(0) + offset * scale.stride(1) + h * scale.stride(2)];
        dequantize_row(row, s, D, dst[h / Hkv] + (t * Hkv + h % Hkv) * D);
      }
    }
  });
  return {k, v};
}

// What prefill attention reads where Q K^T runs in int8 (slim_attention with k_scale): K as the pool stores it, its
// codes [length, Hkv, D] int8 and scales [length, Hkv] fp32, and V dequantized [length, Hkv, D] bf16 (as
// gather_kv_int8's), in one pass; the same arguments as gather_kv_int8
std::tuple<at::Tensor, at::Tensor, at::Tensor> gather_context_int8(const at::Tensor& kv, const at::Tensor& scale,
                                                                   const at::Tensor& block_table, int64_t length) {
  const at::Tensor ids = block_ids(kv, scale, block_table, length);
  const int64_t B = kv.size(1), Hkv = kv.size(2) / 2, D = kv.size(3);
  const int64_t* id = ids.data_ptr<int64_t>();
  auto k = at::empty({length, Hkv, D}, kv.options());
  auto k_scale = at::empty({length, Hkv}, scale.options());
  auto v = at::empty({length, Hkv, D}, kv.options().dtype(at::kBFloat16));
  const int8_t* codes = kv.data_ptr<int8_t>();
  const float* scales = scale.data_ptr<float>();
  int8_t* kd = k.data_ptr<int8_t>();
  float* ksd = k_scale.data_ptr<float>();
  bf16* vd = v.data_ptr<bf16>();
  at::parallel_for(0, length, kTokensPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t block = id[t / B], offset = t % B;
      const int8_t* row = codes + block * kv.stride(0) + offset * kv.stride(1);  // K heads, then V heads
      const float* s = scales + block * scale.stride(0) + offset * scale.stride(1);
      for (int64_t h = 0; h < Hkv; ++h) {
        std::memcpy(kd + (t * Hkv + h) * D, row + h * kv.stride(2), D);
        ksd[t * Hkv + h] = s[h * scale.stride(2)];
        dequantize_row(row + (Hkv + h) * kv.stride(2), s[(Hkv + h) * scale.stride(2)], D, vd + (t * Hkv + h) * D);
      }
    }
  });
  return {k, k_scale, v};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cpuserve, m) {
  m.def("gather_kv_int8(Tensor kv, Tensor scale, Tensor block_table, int length) -> (Tensor, Tensor)");
  m.def("gather_context_int8(Tensor kv, Tensor scale, Tensor block_table, int length) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(cpuserve, CPU, m) {
  m.impl("gather_kv_int8", &gather_kv_int8);
  m.impl("gather_context_int8", &gather_context_int8);
}
