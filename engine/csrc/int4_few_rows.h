// int4 weight x bf16 activation product for few rows (decode), on torch's own int4 packing: int4_gemm.cpp
// calls it below kInt4FewRowsMax rows. See int4_few_rows.cpp.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace cpuserve_int4 {

// Up to this many rows the register kernel of int4_few_rows.cpp runs; from the next row on, the tiled kernel.
constexpr int64_t kInt4FewRowsMax = 16;

// out[M, N] (bf16, contiguous, may be a replica group's shared-memory slot) = x[M, K] (bf16) times the int4
// weight: torch's _weight_int4pack_mm_for_cpu bit for bit. The caller has checked shapes and dtypes.
void few_rows_gemm(const at::BFloat16* x, int64_t M, int64_t K, const uint8_t* packed, int64_t group,
                   const at::BFloat16* scales_and_zeros, int64_t N, at::BFloat16* out);

}  // namespace cpuserve_int4
