// SlimAttention for fp32 prefill (fp32 weights' activations), the fp32 half of torch.ops.cpuserve.slim_attention
// (slim_attention.cpp dispatches fp32 q, k and v here): the bf16 kernel's scheme with fp32 products on AVX-512
// (fp32_dot.h). engine/layers/attention.py's slim_attention is the plain-torch reference.
//
// A task is one kv head and one block of query rows (with the head's g query heads, M = rows * g rows of A). Its
// score rows against every key it can see come from one product per key block of 256 keys (K^T packed once per
// call, [D][256] a block), each row's max taken while the block is still in cache; then a plain fp32 softmax over
// each whole row, written over its scores, and P x V over the block's keys in chunks (V packed once per call,
// [T][D] a head), each row scaled by 1 / its sum at the end.
//
// Why a kernel of its own: torch's fp32 matmul (the plain-torch path) rounds a row otherwise by the number of rows
// and keys of its block, so a prompt whose prefix came from the prefix cache, or was prefilled in chunks, got other
// bits than the same prompt prefilled whole. Here each score is one chain of fused multiply-adds over the head's dims
// and each output one over the keys from the row block's first key block, where the keys a row may not see add exact
// zeros (P = 0; V past the last key is zero too): a query row's result does not depend on which other rows share
// its block or where the chunk started.
//
// window > 0 (a sliding-window layer, Gemma 3): as slim_attention.cpp's: a row block starts at the key block holding
// its first row's first key, and the keys of that block before a row's first one get P = 0.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "fp32_dot.h"
#include "slim_rows.h"
#include "tasks.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace cpuserve_slim {

#if defined(__AVX512F__)
namespace {

constexpr int64_t kValueChunk = 128;  // keys per P V pass: their strip of V (32 KiB at D = 64) stays in L1

// K^T per key block (kp[h][kb][d][t] = k[kb * 256 + t][h][d], zero past T) and V per head (vp[h][t][d], zero rows
// past T), for every kv head and key block
void pack(const at::Tensor& k, const at::Tensor& v, int64_t nkb, float* kp, float* vp) {
  const int64_t T = k.size(0), Hkv = k.size(1), D = k.size(2), block_elems = kKeyBlock * D;
  const float* kd = k.data_ptr<float>();
  const float* vd = v.data_ptr<float>();
  at::parallel_for(0, Hkv * nkb, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / nkb, kb = task % nkb, t0 = kb * kKeyBlock, n = std::min(kKeyBlock, T - t0);
      pack_keys(kd + (t0 * Hkv + h) * D, Hkv * D, n, D, 0u, reinterpret_cast<uint32_t*>(kp + task * block_elems));
      float* dst = vp + task * block_elems;  // the head's rows t0 .. t0 + 256: task = h * nkb + kb
      for (int64_t t = 0; t < kKeyBlock; ++t) {
        if (t < n)
          std::memcpy(dst + t * D, vd + ((t0 + t) * Hkv + h) * D, D * sizeof(float));
        else
          std::fill(dst + t * D, dst + (t + 1) * D, 0.f);
      }
    }
  });
}

inline void store_fp32(float* p, __m512 e, __mmask16 live) { _mm512_mask_storeu_ps(p, live, e); }

}  // namespace
#endif

bool fp32_supported() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

at::Tensor slim_attention_fp32(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t q_start,
                               double sm_scale, int64_t block_rows, int64_t window) {
  TORCH_CHECK(fp32_supported(), "slim_attention: fp32 needs AVX-512 (this level runs attention.py's plain-torch path)");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "slim_attention: fp32 q needs fp32 k and v");
  TORCH_CHECK(q.dim() == 3 && q.stride(-1) == 1 && q.stride(1) == q.size(2), "q must be [L, H, D] with dense rows");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous() && k.sizes() == v.sizes() && k.dim() == 3,
              "k and v must be contiguous [T, Hkv, D]");
  TORCH_CHECK(block_rows > 0, "block_rows must be positive, got ", block_rows);
  const int64_t L = q.size(0), H = q.size(1), D = q.size(2), T = k.size(0), Hkv = k.size(1);
  TORCH_CHECK(T == q_start + L, "k/v length ", T, " must equal q_start + L = ", q_start + L);
  TORCH_CHECK(k.size(2) == D && H % Hkv == 0, "head_dim must match; Hkv must divide H");
  auto out = at::empty({L, H, D}, q.options());
#if defined(__AVX512F__)
  const int64_t g = H / Hkv, nkb = (T + kKeyBlock - 1) / kKeyBlock, t_pad = nkb * kKeyBlock;
  // row stride of the score buffer: 64 floats past the keys, so consecutive rows do not sit a multiple of 4 KiB apart
  const int64_t ld = t_pad + 64;
  const float scale = static_cast<float>(sm_scale);
  auto kp = at::empty({Hkv, nkb, D, kKeyBlock}, k.options());
  auto vp = at::empty({Hkv, t_pad, D}, v.options());
  float* kpd = kp.data_ptr<float>();
  float* vpd = vp.data_ptr<float>();
  pack(k, v, nkb, kpd, vpd);

  const float* qd = q.data_ptr<float>();
  float* od = out.data_ptr<float>();
  const int64_t q_row = q.stride(0), num_row_blocks = (L + block_rows - 1) / block_rows;
  // longest row blocks first, each thread taking the next task (slim_attention.cpp says why)
  cpuserve_tasks::share_tasks(Hkv * num_row_blocks, [&](const auto& next) {
    const int64_t m_max = block_rows * g;
    std::vector<float> a(m_max * D), s(m_max * ld), o(m_max * D), inv_sum(m_max), mx(m_max);
    for (int64_t task; (task = next()) >= 0;) {
      const int64_t h = task % Hkv, rb = num_row_blocks - 1 - task / Hkv;
      const int64_t start = rb * block_rows, rows = std::min(block_rows, L - start), m = rows * g;
      const int64_t end_key = q_start + start + rows;  // keys past the block's last query are never seen
      // row i = r * g + j: query r, head h * g + j
      for (int64_t r = 0; r < rows; ++r)
        std::memcpy(a.data() + r * g * D, qd + (start + r) * q_row + h * g * D, g * D * sizeof(float));
      const int64_t blocks = (end_key + kKeyBlock - 1) / kKeyBlock;
      // first key of row i (0 without a window); key blocks before the block's first row's first key are skipped
      const auto first_key = [&](int64_t i) {
        return window > 0 ? std::max<int64_t>(0, q_start + start + i / g + 1 - window) : int64_t{0};
      };
      const int64_t key0 = first_key(0) / kKeyBlock * kKeyBlock;
      std::fill(mx.begin(), mx.begin() + m, -INFINITY);
      for (int64_t kb = key0 / kKeyBlock; kb < blocks; ++kb) {
        const int64_t seen = std::min(kKeyBlock, end_key - kb * kKeyBlock);
        cpuserve_fp32dot::gemm(m, seen, D, a.data(), D, kpd + (h * nkb + kb) * kKeyBlock * D, kKeyBlock,
                               s.data() + kb * kKeyBlock, ld, false);
        for (int64_t i = 0; i < m; ++i) {  // row maxima while the block's scores are still in cache
          const int64_t valid = std::min(q_start + start + i / g + 1 - kb * kKeyBlock, kKeyBlock);
          const int64_t lo = std::max<int64_t>(first_key(i) - kb * kKeyBlock, 0);
          if (valid > lo) mx[i] = row_max(s.data() + i * ld + kb * kKeyBlock + lo, valid - lo, mx[i]);
        }
      }
      for (int64_t i = 0; i < m; ++i) {  // P over the scores: zero before the row's first key and past its last
        const int64_t valid = q_start + start + i / g + 1, lo = first_key(i);
        float* si = s.data() + i * ld;
        std::fill(si + key0, si + lo, 0.f);
        inv_sum[i] = softmax_row(si + lo, valid - lo, end_key - lo, mx[i], scale, si + lo, store_fp32);
      }
      for (int64_t c0 = key0; c0 < end_key; c0 += kValueChunk)  // o = P V, chunk by chunk into the same sums
        cpuserve_fp32dot::gemm(m, D, std::min(kValueChunk, end_key - c0), s.data() + c0, ld, vpd + (h * t_pad + c0) * D,
                               D, o.data(), D, c0 > key0);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < g; ++j) {
          float* dst = od + ((start + r) * H + h * g + j) * D;
          const float* src = o.data() + (r * g + j) * D;
          const float inv = inv_sum[r * g + j];
          for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * inv;
        }
    }
  });
#endif
  return out;
}

}  // namespace cpuserve_slim
