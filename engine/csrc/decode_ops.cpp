// Fused CPU kernels for the decode hot path, registered as torch.ops.cpuserve.*.
//
// Eager PyTorch spends most of a batch-1 decode step dispatching ~40 small ops per layer (RMSNorm's composite,
// RoPE's slices and cats, the KV quantize-and-scatter, the paged attention's gathers and casts). Each op here
// replaces one such chain with one pass over the data. Numerics follow the plain-torch path in
// engine/layers: fp32 arithmetic, one rounding to the activation dtype at the end.
//
// Built on first use by engine/layers/native.py (torch.utils.cpp_extension, -O3 -march=native).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"
#include "simd.h"
#include "tasks.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

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

void check_cpu_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// Calls fn(T{}) with T the activation type: float32 or bfloat16 (the engine's two activation dtypes).
template <typename Fn>
void dispatch_act(at::ScalarType dtype, const char* name, Fn&& fn) {
  switch (dtype) {
    case at::kFloat: fn(float{}); break;
    case at::kBFloat16: fn(at::BFloat16{}); break;
    default: TORCH_CHECK(false, name, ": activations must be float32 or bfloat16, got ", dtype);
  }
}

// Calls fn(ptr) with the pool's data pointer typed as int8, bfloat16 or float32.
template <typename Fn>
void dispatch_cache(at::Tensor& pool, Fn&& fn) {
  switch (pool.scalar_type()) {
    case at::kChar: fn(pool.data_ptr<int8_t>()); break;
    case at::kBFloat16: fn(pool.data_ptr<at::BFloat16>()); break;
    case at::kFloat: fn(pool.data_ptr<float>()); break;
    default: TORCH_CHECK(false, "kv pool dtype ", pool.scalar_type(), " is not int8, bfloat16 or float32");
  }
}

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
      scores.resize(g * len), ks.resize(len), vs.resize(len), krows.resize(len), vrows.resize(len), slots.resize(len);
      for (int64_t t = 0, b = t0 / B, i = t0 % B; t < len; ++t, i = i + 1 == B ? (++b, 0) : i + 1)
        slots[t] = static_cast<int64_t>(table[b]) * B + i;  // key t0 + t's slot, block by block (no divisions)
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

// out: contiguous, q's dtype, the given sizes (a replica group's shared-memory slot, written in place)
void check_out(const at::Tensor& out, const at::Tensor& like, at::IntArrayRef sizes) {
  TORCH_CHECK(out.device().is_cpu() && out.is_contiguous() && out.scalar_type() == like.scalar_type() &&
                  out.sizes() == sizes,
              "out must be a contiguous CPU ", like.scalar_type(), " tensor of sizes ", sizes, ", got ",
              out.scalar_type(), " ", out.sizes(), out.is_contiguous() ? "" : " (not contiguous)");
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
      const __m512 a = _mm512_sub_ps(_mm512_mul_ps(lo, _mm512_loadu_ps(c + i)), _mm512_mul_ps(hi, _mm512_loadu_ps(s + i)));
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
at::Tensor& decode_attention_out(const at::Tensor& q, const at::Tensor& kv, const c10::optional<at::Tensor>& scale,
                                 const at::Tensor& block_tables, const at::Tensor& context_lens, double sm_scale,
                                 at::Tensor& out) {
  return ::decode_attention_out(q, kv, scale, block_tables, context_lens, sm_scale, /*window=*/0, out);
}

}  // namespace cpuserve_ops

TORCH_LIBRARY(cpuserve, m) {
  m.def("decode_attention(Tensor q, Tensor kv, Tensor? scale, Tensor block_tables, Tensor context_lens, "
        "float sm_scale, int window=0) -> Tensor");
  m.def("decode_attention.out(Tensor q, Tensor kv, Tensor? scale, Tensor block_tables, Tensor context_lens, "
        "float sm_scale, int window=0, *, Tensor(a!) out) -> Tensor(a!)");
  m.def("rope_write_kv(Tensor(a!) qkv, Tensor cos, Tensor sin, int n_heads, Tensor(b!) pool, Tensor(c!)? pool_scale, "
        "Tensor slot_mapping) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("silu_mul.out(Tensor gate_up, *, Tensor(a!) out) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(cpuserve, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("decode_attention.out", &decode_attention_out);
  m.impl("rope_write_kv", &rope_write_kv);
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("silu_mul.out", &silu_mul_out);
}
