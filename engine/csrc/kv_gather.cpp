// One sequence's context read back from an int8 KV pool for prefill attention, dequantized to bf16 in one pass.
//
// The plain-torch path (engine/layers/kv_quant.py gather_kv) takes four ops per call: index_select of the blocks,
// a copy to fp32, the multiply by the scales, a copy back to bf16; two calls per layer per prefilled sequence.
// Here each (token, head) row is read once and written once: out[t][h][d] = bf16(float(code) * scale[t][h]), the
// reference's fp32 multiply and round-half-to-even, so the two give the same bits.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "simd.h"

#include <cstdint>

namespace {

using bf16 = at::BFloat16;
constexpr int64_t kTokensPerTask = 64;

// cache [num_blocks, B, Hkv, D] int8 with contiguous rows, scale [num_blocks, B, Hkv] fp32 (views of a pool that
// holds K and V heads side by side: any strides), block_table [>= ceil(length / B)] int32 or int64 -> [length, Hkv,
// D] bf16
at::Tensor gather_kv_int8(const at::Tensor& cache, const at::Tensor& scale, const at::Tensor& block_table,
                          int64_t length) {
  TORCH_CHECK(cache.scalar_type() == at::kChar && cache.dim() == 4 && cache.stride(3) == 1,
              "cache must be int8 [num_blocks, B, Hkv, D] with contiguous rows, got ", cache.scalar_type(), " ",
              cache.sizes(), " strides ", cache.strides());
  const int64_t num_blocks = cache.size(0), B = cache.size(1), Hkv = cache.size(2), D = cache.size(3);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.sizes() == at::IntArrayRef({num_blocks, B, Hkv}),
              "scale must be fp32 [", num_blocks, ", ", B, ", ", Hkv, "], got ", scale.scalar_type(), " ",
              scale.sizes());
  const int64_t used = (length + B - 1) / B;
  TORCH_CHECK(length >= 0 && block_table.dim() == 1 && block_table.size(0) >= used,
              "block_table must hold at least ceil(length / B) = ", used, " blocks, got ", block_table.sizes());
  const at::Tensor ids = block_table.slice(0, 0, used).to(at::kLong).contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < used; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < num_blocks, "block_table[", i, "] = ", id[i], " is not a block of the pool (",
                num_blocks, ")");
  auto out = at::empty({length, Hkv, D}, cache.options().dtype(at::kBFloat16));
  const int8_t* codes = cache.data_ptr<int8_t>();
  const float* scales = scale.data_ptr<float>();
  bf16* dst = out.data_ptr<bf16>();
  at::parallel_for(0, length, kTokensPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t block = id[t / B], offset = t % B;
      for (int64_t h = 0; h < Hkv; ++h) {
        const int8_t* row = codes + block * cache.stride(0) + offset * cache.stride(1) + h * cache.stride(2);
        const float s = scales[block * scale.stride(0) + offset * scale.stride(1) + h * scale.stride(2)];
        bf16* o = dst + (t * Hkv + h) * D;
        int64_t d = 0;
#if defined(__AVX512F__)
        for (; d + 16 <= D; d += 16) {
          const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d));
          const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c)), _mm512_set1_ps(s));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + d), cpuserve_simd::to_bf16_exact(v));
        }
#endif
        for (; d < D; ++d) o[d] = static_cast<bf16>(static_cast<float>(row[d]) * s);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cpuserve, m) {
  m.def("gather_kv_int8(Tensor cache, Tensor scale, Tensor block_table, int length) -> Tensor");
}

TORCH_LIBRARY_IMPL(cpuserve, CPU, m) { m.impl("gather_kv_int8", &gather_kv_int8); }
