// One sequence's context read back from a layer's int8 KV pool for prefill attention: K and V, dequantized to bf16
// in one pass over the block table.
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
#include <tuple>

namespace {

using bf16 = at::BFloat16;
using cpuserve_rows::load;
using cpuserve_rows::store;
constexpr int64_t kTokensPerTask = 64;

// kv [num_blocks, B, 2 * Hkv, D] int8 (K heads, then V heads) with contiguous rows, scale [num_blocks, B, 2 * Hkv]
// fp32 (any strides), block_table [>= ceil(length / B)] int32 or int64 -> K and V, each [length, Hkv, D] bf16
std::tuple<at::Tensor, at::Tensor> gather_kv_int8(const at::Tensor& kv, const at::Tensor& scale,
                                                  const at::Tensor& block_table, int64_t length) {
  TORCH_CHECK(kv.scalar_type() == at::kChar && kv.dim() == 4 && kv.size(2) % 2 == 0 && kv.stride(3) == 1,
              "kv must be int8 [num_blocks, B, 2 * Hkv, D] with contiguous rows, got ", kv.scalar_type(), " ",
              kv.sizes(), " strides ", kv.strides());
  const int64_t num_blocks = kv.size(0), B = kv.size(1), heads = kv.size(2), Hkv = heads / 2, D = kv.size(3);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.sizes() == at::IntArrayRef({num_blocks, B, heads}),
              "scale must be fp32 [", num_blocks, ", ", B, ", ", heads, "], got ", scale.scalar_type(), " ",
              scale.sizes());
  const int64_t used = (length + B - 1) / B;
  TORCH_CHECK(length >= 0 && block_table.dim() == 1 && block_table.size(0) >= used,
              "block_table must hold at least ceil(length / B) = ", used, " blocks, got ", block_table.sizes());
  const at::Tensor ids = block_table.slice(0, 0, used).to(at::kLong).contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < used; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < num_blocks, "block_table[", i, "] = ", id[i], " is not a block of the pool (",
                num_blocks, ")");
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
        bf16* o = dst[h / Hkv] + (t * Hkv + h % Hkv) * D;
        int64_t d = 0;
#if defined(__AVX512F__)
        for (; d + 16 <= D; d += 16)
          cpuserve_simd::store16(o + d, _mm512_mul_ps(cpuserve_simd::load16(row + d), _mm512_set1_ps(s)));
#endif
        for (; d < D; ++d) o[d] = store<bf16>(load(row[d]) * s);
      }
    }
  });
  return {k, v};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cpuserve, m) {
  m.def("gather_kv_int8(Tensor kv, Tensor scale, Tensor block_table, int length) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(cpuserve, CPU, m) { m.impl("gather_kv_int8", &gather_kv_int8); }
