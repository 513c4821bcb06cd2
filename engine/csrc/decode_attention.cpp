// Decode attention over the paged KV pool, registered as torch.ops.cpuserve.decode_attention (and .out): one new
// query token per sequence against its cached keys and values, fp32 arithmetic, one rounding to the activation
// dtype at the end, as the plain-torch paged_decode_attention in engine/layers/attention.py that the tests compare
// against.
//
// Built on first use by engine/layers/native.py (torch.utils.cpp_extension, -O3 -march=native).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"
#include "rows.h"
#include "simd.h"
#include "tasks.h"
#include "warm.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using namespace cpuserve_rows;

// ---- decode attention over a paged KV pool ------------------------------------------------------------------
//
// q [S, H, D] (any stride but the last: a slice of the fused qkv rows); kv [num_blocks, B, 2 * Hkv, D] (K heads,
// then V heads); scale [num_blocks, B, 2 * Hkv] fp32 for int8 pools; block_tables [S, max_blocks] int32;
// context_lens [S] int32. A task is one sequence and a range of its kv heads. Per kv head, its g query heads score
// every context token (scaled by the token's K scale), sixteen tokens at a time with their sums reduced together;
// softmax; then the V rows weighted by p * V scale are summed, each column block's sums held in registers over the
// whole context. Only the first context_lens[s] tokens are read, so unwritten slots never matter.
// window > 0 (a sliding-window layer, Gemma 3): only the last `window` of them, t >= len - window.

// sc[t] = exp(sc[t] - max) over a row of scores, in place; returns their sum. Sixteen at a time where the CPU has
// AVX-512: a scalar exp per score took over half of a 32-sequence decode step's attention.
inline float softmax_numerators(float* sc, int64_t len) {
#if defined(__AVX512F__)
  __m512 mx = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < len; t += 16) {
    const __mmask16 live = len - t >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (len - t)) - 1);
    mx = _mm512_mask_max_ps(mx, live, mx, _mm512_maskz_loadu_ps(live, sc + t));
  }
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  for (int64_t t = 0; t < len; t += 16) {
    const __mmask16 live = len - t >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (len - t)) - 1);
    const __m512 e = cpuserve_simd::exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, sc + t), m));
    _mm512_mask_storeu_ps(sc + t, live, e);
    sum = _mm512_mask_add_ps(sum, live, sum, e);
  }
  return _mm512_reduce_add_ps(sum);
#else
  const float m = *std::max_element(sc, sc + len);
  float sum = 0.f;
  for (int64_t t = 0; t < len; ++t) {
    sc[t] = std::exp(sc[t] - m);
    sum += sc[t];
  }
  return sum;
#endif
}

// The portable path (no AVX-512, or D not a multiple of 16): per token, each query row's dot product, then the
// V row weighted by p * V scale
inline void score_row(const float* qf, int64_t n, const float* k, int64_t D, float ks, float* out, int64_t stride) {
  for (int64_t j = 0; j < n; ++j) out[j * stride] = dot(qf + j * D, k, D) * ks;
}

inline void accumulate_row(float* acc, int64_t n, const float* v, int64_t D, const float* w, int64_t stride) {
  for (int64_t j = 0; j < n; ++j) {
    const float wj = w[j * stride];
    for (int64_t d = 0; d < D; ++d) acc[j * D + d] += wj * v[d];
  }
}

#if defined(__AVX512F__)
// Lane i of the result is the sum of v[i]'s 16 lanes: 45 shuffles and adds for 16 sums, where one
// _mm512_reduce_add_ps per sum takes about 8.
inline __m512 sum_lanes16(const __m512* v) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: v[2i] 0+2, v[2i+1] 0+2, v[2i] 1+3, v[2i+1] 1+3
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the lane's sum of v[4i] .. v[4i+3]
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
  const __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, 0x88), _mm512_shuffle_f32x4(c0, c1, 0xDD));
}

// scores[j * len + t], t < nt <= 16, of the n query rows qf [n, D] against the K rows kf [16, D] (fp32, rows past
// nt ignored), times each token's K scale ks[t]: sixteen tokens' sums in registers, reduced together
inline void score_block(const float* qf, int64_t n, int64_t D, const float* kf, const float* ks, int64_t nt,
                        float* scores, int64_t len) {
  const __mmask16 live = nt == 16 ? __mmask16(0xFFFF) : __mmask16((1u << nt) - 1);
  const __m512 ksv = _mm512_maskz_loadu_ps(live, ks);
  for (int64_t j = 0; j < n; ++j) {
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < D; c += 16) {
      const __m512 qc = _mm512_loadu_ps(qf + j * D + c);
      for (int i = 0; i < 16; ++i) acc[i] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(kf + i * D + c), acc[i]);
    }
    _mm512_mask_storeu_ps(scores + j * len, live, _mm512_mul_ps(sum_lanes16(acc), ksv));
  }
}

// acc[j * D .. + 16] (columns c..c+15 of query row j, j < J) += sum over tokens t of w[j * len + t] * v_t[c..], v_t
// the V row at vrows[t]; w already holds p * V scale. The J x 16 sums stay in registers across all the tokens.
template <int J, typename cache_t>
void accumulate_columns_n(float* acc, int64_t D, const cache_t* const* vrows, int64_t len, int64_t c, const float* w) {
  __m512 a[J];
  for (int j = 0; j < J; ++j) a[j] = _mm512_loadu_ps(acc + j * D);
  for (int64_t t = 0; t < len; ++t) {
    const __m512 vc = load16(vrows[t] + c);
    for (int j = 0; j < J; ++j) a[j] = _mm512_fmadd_ps(_mm512_set1_ps(w[j * len + t]), vc, a[j]);
  }
  for (int j = 0; j < J; ++j) _mm512_storeu_ps(acc + j * D, a[j]);
}

template <typename cache_t>
void accumulate_columns(float* acc, int64_t n, int64_t D, const cache_t* const* vrows, int64_t len, int64_t c,
                        const float* w) {
  switch (n) {  // 1..4 query rows
    case 1: return accumulate_columns_n<1>(acc, D, vrows, len, c, w);
    case 2: return accumulate_columns_n<2>(acc, D, vrows, len, c, w);
    case 3: return accumulate_columns_n<3>(acc, D, vrows, len, c, w);
    default: return accumulate_columns_n<4>(acc, D, vrows, len, c, w);
  }
}
#endif

// One task's kv head: scores[j * len + t] of its g query rows qf [g, D] against the keys at krows[t] (scales ks[t]),
// fp32 scratch kf [16 * D]
template <typename cache_t>
void score_head(const float* qf, int64_t g, int64_t D, const cache_t* const* krows, const float* ks, int64_t len,
                float* kf, float* scores) {
#if defined(__AVX512F__)
  if (D % 16 == 0) {  // sixteen tokens at a time, their K rows converted to fp32 once for all g query rows
    for (int64_t t0 = 0; t0 < len; t0 += 16) {
      const int64_t nt = std::min<int64_t>(16, len - t0);
      for (int64_t i = 0; i < nt; ++i)
        for (int64_t c = 0; c < D; c += 16) _mm512_storeu_ps(kf + i * D + c, load16(krows[t0 + i] + c));
      score_block(qf, g, D, kf, ks + t0, nt, scores + t0, len);
    }
    return;
  }
#endif
  for (int64_t t = 0; t < len; ++t) {
    load_row(krows[t], kf, D);
    score_row(qf, g, kf, D, ks[t], scores + t, len);
  }
}

// acc [g, D] = sum over t of w[j * len + t] * V row at vrows[t] (w: p * V scale), v: fp32 scratch [D]
template <typename cache_t>
void accumulate_head(float* acc, int64_t g, int64_t D, const cache_t* const* vrows, int64_t len, const float* w,
                     float* v) {
  std::fill(acc, acc + g * D, 0.f);
#if defined(__AVX512F__)
  if (D % 16 == 0) {
    for (int64_t c = 0; c < D; c += 16)
      for (int64_t j = 0; j < g; j += 4)
        accumulate_columns(acc + j * D + c, std::min<int64_t>(4, g - j), D, vrows, len, c, w + j * len);
    return;
  }
#endif
  for (int64_t t = 0; t < len; ++t) {
    load_row(vrows[t], v, D);
    accumulate_row(acc, g, v, D, w + t, len);
  }
}

// Reads a sequence's context blocks (its K and V rows of every kv head, and their scales) front to back before any
// arithmetic. The kernel visits a block one kv head at a time, K rows then V rows, each 2 * Hkv rows apart: strided
// reads the hardware prefetchers barely follow. In a decode step the weights stream through the caches between one
// layer's attention and the next step's, so every sequence's context comes from memory, and came a line at a time.
// 32 sequences x 192 tokens, SmolLM2's heads, 30 layers' pools: 265 -> 143-156 us a layer.
template <typename cache_t>
void warm_blocks(const cache_t* kv, const float* scale, const int32_t* table, int64_t first_block, int64_t last_block,
                 int64_t block_elems, int64_t block_scales) {
  uint64_t sink = 0;
  for (int64_t b = first_block; b <= last_block; ++b) {
    const int64_t block = table[b];
    sink ^= cpuserve_warm::read_lines(kv + block * block_elems, block_elems * static_cast<int64_t>(sizeof(cache_t)));
    if (scale) sink ^= cpuserve_warm::read_lines(scale + block * block_scales, block_scales * 4);
  }
  cpuserve_warm::keep(sink);
}

template <typename cache_t, typename act_t>
void decode_attention_kernel(const act_t* q, int64_t q_stride_s, int64_t q_stride_h, const cache_t* kv,
                             const float* scale, const int32_t* tables, const int32_t* lens, act_t* out, int64_t S,
                             int64_t H, int64_t Hkv, int64_t D, int64_t B, int64_t max_blocks, float sm_scale,
                             int64_t window) {
  const int64_t g = H / Hkv;
  const int64_t row = 2 * Hkv;  // heads per pool slot
  // whole sequences per task when there are enough of them to keep every thread busy, else one kv head each
  const int64_t per_task = S >= at::get_num_threads() ? Hkv : 1;
  const int64_t tasks_per_seq = Hkv / per_task, num_tasks = S * tasks_per_seq;
  // sequences differ in length, so threads take the next task from a shared counter rather than a fixed share
  cpuserve_tasks::share_tasks(num_tasks, [&](const auto& next) {
    std::vector<float> qf(g * D), acc(g * D), kf(16 * D), inv(g), scores, ks, vs;
    std::vector<const cache_t*> krows, vrows;
    std::vector<int64_t> slots;
    for (int64_t task; (task = next()) >= 0;) {
      const int64_t s = task / tasks_per_seq;
      const int64_t t0 = window > 0 ? std::max<int64_t>(0, lens[s] - window) : 0;  // first key seen
      const int64_t len = lens[s] - t0;
      const int32_t* table = tables + s * max_blocks;
      scores.resize(g * len), ks.resize(len), vs.resize(len);
      krows.resize(len), vrows.resize(len), slots.resize(len);
      for (int64_t t = 0, b = t0 / B, i = t0 % B; t < len; ++t, i = i + 1 == B ? (++b, 0) : i + 1)
        slots[t] = static_cast<int64_t>(table[b]) * B + i;  // key t0 + t's slot, block by block (no divisions)
      if (per_task == Hkv) warm_blocks(kv, scale, table, t0 / B, (lens[s] - 1) / B, B * row * D, B * row);
      for (int64_t h = task % tasks_per_seq * per_task; h < (task % tasks_per_seq + 1) * per_task; ++h) {
        for (int64_t t = 0; t < len; ++t) {  // kv head h of key t0 + t: its K and V rows and scales
          const int64_t slot = slots[t];
          krows[t] = kv + (slot * row + h) * D, vrows[t] = kv + (slot * row + Hkv + h) * D;
          ks[t] = scale ? scale[slot * row + h] : 1.f, vs[t] = scale ? scale[slot * row + Hkv + h] : 1.f;
        }
        for (int64_t j = 0; j < g; ++j) {  // query heads h*g .. h*g+g-1, pre-scaled
          load_row(q + s * q_stride_s + (h * g + j) * q_stride_h, qf.data() + j * D, D);
          for (int64_t d = 0; d < D; ++d) qf[j * D + d] *= sm_scale;
        }
        score_head(qf.data(), g, D, krows.data(), ks.data(), len, kf.data(), scores.data());
        for (int64_t j = 0; j < g; ++j) {
          float* p = scores.data() + j * len;
          inv[j] = 1.f / softmax_numerators(p, len);
          for (int64_t t = 0; t < len; ++t) p[t] *= vs[t];  // each V row's weight, p * its scale
        }
        accumulate_head(acc.data(), g, D, vrows.data(), len, scores.data(), kf.data());
        for (int64_t j = 0; j < g; ++j) {
          act_t* o = out + (s * H + h * g + j) * D;
          for (int64_t d = 0; d < D; ++d) o[d] = store<act_t>(acc[j * D + d] * inv[j]);
        }
      }
    }
  });
}

at::Tensor& decode_attention_out(const at::Tensor& q, const at::Tensor& kv, const c10::optional<at::Tensor>& scale,
                                 const at::Tensor& block_tables, const at::Tensor& context_lens, double sm_scale,
                                 int64_t window, at::Tensor& out) {
  TORCH_CHECK(q.device().is_cpu() && q.stride(-1) == 1, "q must be a CPU tensor with contiguous rows");
  check_cpu_contiguous(kv, "kv");
  check_cpu_contiguous(block_tables, "block_tables");
  check_cpu_contiguous(context_lens, "context_lens");
  TORCH_CHECK(q.dim() == 3 && kv.dim() == 4, "q must be [S, H, D] and kv [num_blocks, B, 2 * Hkv, D]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              "block_tables and context_lens must be int32");
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t B = kv.size(1), Hkv = kv.size(2) / 2;
  TORCH_CHECK(kv.size(3) == D && Hkv > 0 && H % Hkv == 0, "kv heads must divide the query heads");
  const float* sp = nullptr;
  if (kv.scalar_type() == at::kChar) {
    TORCH_CHECK(scale.has_value(), "an int8 pool needs its scales");
    check_cpu_contiguous(*scale, "scale");
    TORCH_CHECK(scale->scalar_type() == at::kFloat, "scale must be float32");
    sp = scale->data_ptr<float>();
  }
  check_out(out, q, {S, H, D});
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int64_t max_blocks = block_tables.size(1);
  at::Tensor pool = kv;
  dispatch_act(q.scalar_type(), "decode_attention", [&](auto act) {
    using act_t = decltype(act);
    dispatch_cache(pool, [&](auto* cache) {
      decode_attention_kernel(q.data_ptr<act_t>(), q.stride(0), q.stride(1), cache, sp, tables, lens,
                              out.data_ptr<act_t>(), S, H, Hkv, D, B, max_blocks, static_cast<float>(sm_scale),
                              window);
    });
  });
  return out;
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kv, const c10::optional<at::Tensor>& scale,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, double sm_scale,
                            int64_t window) {
  TORCH_CHECK(q.dim() == 3, "q must be [S, H, D]");
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  return decode_attention_out(q, kv, scale, block_tables, context_lens, sm_scale, window, out);
}

}  // namespace

at::Tensor& cpuserve_ops::decode_attention_out(const at::Tensor& q, const at::Tensor& kv,
                                               const c10::optional<at::Tensor>& scale, const at::Tensor& block_tables,
                                               const at::Tensor& context_lens, double sm_scale, at::Tensor& out) {
  return ::decode_attention_out(q, kv, scale, block_tables, context_lens, sm_scale, /*window=*/0, out);
}

TORCH_LIBRARY_FRAGMENT(cpuserve, m) {
  m.def("decode_attention(Tensor q, Tensor kv, Tensor? scale, Tensor block_tables, Tensor context_lens, "
        "float sm_scale, int window=0) -> Tensor");
  m.def("decode_attention.out(Tensor q, Tensor kv, Tensor? scale, Tensor block_tables, Tensor context_lens, "
        "float sm_scale, int window=0, *, Tensor(a!) out) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(cpuserve, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("decode_attention.out", &decode_attention_out);
}
