// SlimAttention for bf16 prefill (xFasterTransformer): causal attention split along query rows only.
//
// A task is one kv head and one block of query rows (with the head's g query heads, M = rows * g rows of A).
// It computes the block's full score rows against every key it can see with one bf16 x bf16 -> fp32 product
// per key block (taking each row's max while the block is still in cache), a plain fp32 softmax over each whole
// row (no online rescaling: the row is complete), and P x V over all those keys. K^T and V are packed once per
// call into VNNI pairs, the layout both product kernels read. Key blocks of 256 keep one block's scores (96 rows
// for SmolLM2) in L2 and waste fewer keys past the diagonal than 512 (1.2x faster at 4096 tokens).
// Same contract as engine/layers/attention.py's slim_attention.
//
// The products run on one of two kernels, the CPU's best chosen at first use (product_kernel()):
//   brgemm       oneDNN's bf16 brgemm, where torch offers it (AMX: Intel Sapphire Rapids and later)
//   avx512_bf16  our vdpbf16ps micro-kernels of bf16_dot.h (AMD Zen 4, and Intel CPUs without AMX)
// On a CPU with neither the op refuses to run and engine/layers/native.py keeps the plain-torch path.
// slim_attention_products() switches between them where the CPU has both (tests: an AMX machine checks the
// avx512_bf16 kernel and its int8 scores too); slim_attention_runs() counts the calls of each path.
//
// With an int8 K and its scales (k_scale: the KV pool's codes, as decode reads them), Q K^T runs as int8 dot products
// instead (int8_scores.h, each query row quantized on its own), on avx512_bf16 only: where brgemm runs, AMX's bf16 is
// faster than VNNI's int8, and the caller passes a bf16 K (engine/layers/ops.py decides). P V stays bf16.
//
// fp32 q, k and v (fp32 weights' activations) go to slim_attention_fp32.cpp: this scheme with fp32 products, on any
// AVX-512 CPU (slim_attention_fp32() says whether this level has it). slim_rows.h holds what the two share.
//
// Every product covers whole key blocks from key 0 (masked keys get P = 0, which adds exact zeros; the
// avx512_bf16 kernel stops at the row block's last key instead, and what it skips no row reads), so a query
// row's result does not depend on which other rows share its block or where the chunk started: a prompt
// prefilled in one piece, in chunks, or after a prefix-cache hit gives bit-identical rows.
//
// window > 0 (a sliding-window layer, Gemma 3): the query at position p sees keys p - window + 1 .. p only. A row
// block starts at the key block holding its first row's first key (what lies before scores nothing), and the keys
// of that block before a row's first one get P = 0, like the causal mask's.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include "act_quant.h"
#include "bf16_dot.h"
#include "int8_scores.h"
#include "simd.h"
#include "slim_rows.h"
#include "tasks.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {

using cpuserve_slim::kKeyBlock;
using cpuserve_slim::pack_keys;
using cpuserve_slim::row_max;
using cpuserve_slim::softmax_row;
constexpr int64_t kValueChunk = 256;  // keys per avx512_bf16 P V pass: its strip of V stays in L1

using bf16 = at::BFloat16;

#if defined(__AVX512F__)
// 16 fp32 -> 16 bf16 in one instruction where the CPU has it (vcvtneps2bf16 flushes denormals to zero: fine for
// softmax weights), else as at::BFloat16 rounds. Here, not in simd.h, so only this file's object differs between
// the avx512_bf16 and avx512_vnni levels' builds (kernel_build.py compiles -mavx512bf16 where the macro is tested).
inline __m256i to_bf16(__m512 x) {
#if defined(__AVX512BF16__)
  return (__m256i)_mm512_cvtneps_pbh(x);
#else
  return cpuserve_simd::to_bf16_exact(x);
#endif
}

// softmax_row's P as bf16
inline void store_bf16(bf16* p, __m512 e, __mmask16 live) { _mm256_mask_storeu_epi16(p, live, to_bf16(e)); }
#else
inline void store_bf16(bf16*) {}  // softmax_row calls it only with AVX-512
#endif


enum class Products { kNone, kBrgemm, kAvx512Bf16 };

// A thread's buffers for its row-block tasks: A (bf16 q rows), P, the scores, P V, each row's 1 / sum and max; with an
// int8 K, the q rows' codes, group scales, scaled and integer code sums, and score offsets
struct Scratch {
  std::vector<bf16> a, p;
  std::vector<float> s, o, inv_sum, mx;
  std::vector<int8_t> qa;
  std::vector<float> qscale, scaled_sums, starts;
  std::vector<int32_t> code_sums;
};

template <typename T>
void grow(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
}

bool brgemm_available() { return at::native::cpublas::could_pack(at::kBFloat16); }

bool avx512_bf16_available() {
#if defined(__AVX512BF16__)
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

// AMX's peak bf16 rate (brgemm) is 8x that of vdpbf16ps on the same core: prefer it wherever torch offers it
// (not measured against bf16_dot.h on an AMX machine; on Zen 4 the two are within 10%, see bf16_dot.h)
Products best_products() {
  if (brgemm_available()) return Products::kBrgemm;
  if (avx512_bf16_available()) return Products::kAvx512Bf16;
  return Products::kNone;
}

std::atomic<int> g_products{-1};  // the Products in force; -1 until first asked (then best_products())
std::array<std::atomic<int64_t>, 4> g_runs{};  // calls: brgemm, avx512_bf16 with a bf16 K, with an int8 K, fp32

Products product_kernel() {
  int kernel = g_products.load();
  if (kernel < 0) {
    g_products.compare_exchange_strong(kernel, static_cast<int>(best_products()));
    kernel = g_products.load();
  }
  return static_cast<Products>(kernel);
}

// which kernel runs slim_attention's products on this CPU: "brgemm", "avx512_bf16", or "" (the op refuses)
std::string slim_attention_kernel() {
  switch (product_kernel()) {
    case Products::kBrgemm: return "brgemm";
    case Products::kAvx512Bf16: return "avx512_bf16";
    default: return "";
  }
}

// The product kernel: mode "auto" (the CPU's best), "brgemm" or "avx512_bf16" (refused where the CPU has not got
// it), or "" to keep it; returns the kernel in force, as slim_attention_kernel()
std::string slim_attention_products(const std::string& mode) {
  TORCH_CHECK(mode.empty() || mode == "auto" || mode == "brgemm" || mode == "avx512_bf16",
              "slim_attention_products: mode must be auto, brgemm or avx512_bf16, got ", mode);
  TORCH_CHECK(mode != "brgemm" || brgemm_available(),
              "slim_attention_products: torch offers no bf16 brgemm on this CPU (it needs AMX)");
  TORCH_CHECK(mode != "avx512_bf16" || avx512_bf16_available(),
              "slim_attention_products: this CPU (or this build) has no AVX512-BF16");
  if (mode == "auto") g_products = static_cast<int>(best_products());
  if (mode == "brgemm") g_products = static_cast<int>(Products::kBrgemm);
  if (mode == "avx512_bf16") g_products = static_cast<int>(Products::kAvx512Bf16);
  return slim_attention_kernel();
}

// slim_attention's calls so far: [brgemm, avx512_bf16 with a bf16 K, avx512_bf16 with an int8 K, fp32]
std::vector<int64_t> slim_attention_runs() {
  return {g_runs[0].load(), g_runs[1].load(), g_runs[2].load(), g_runs[3].load()};
}

// slim_attention takes fp32 q, k and v on this level (slim_attention_fp32.cpp: AVX-512)
bool slim_attention_fp32() { return cpuserve_slim::fp32_supported(); }

// slim_attention takes an int8 K (Q K^T as int8 dot products) on this CPU
bool slim_attention_int8_keys() {
#if defined(CPUSERVE_VNNI)
  return product_kernel() == Products::kAvx512Bf16;
#else
  return false;
#endif
}

// s[m][kb * 256 ...] = a[m][D] . K^T for key block kb (kblock: [D/2][256][2]); only the first `seen` keys
// of the block are needed (brgemm computes all 256)
void score_block(Products kernel, int64_t m, int64_t D, const bf16* a, const bf16* kblock, float* s, int64_t ld,
                 int64_t seen) {
#if defined(__AVX512BF16__)
  if (kernel == Products::kAvx512Bf16) {
    cpuserve_bf16dot::gemm(m, seen, D / 2, a, D, kblock, kKeyBlock, s, ld, false);
    return;
  }
#endif
  at::native::cpublas::brgemm(m, kKeyBlock, D, D, kKeyBlock, ld, false, a, kblock, s, true);
}

// o[m][D] = p[m][keys] . V (vh: the head's packed V, [keys / 2][D][2]); keys even, p zero past each row's last
// key, so the keys past it add exact zeros
void weigh_values(Products kernel, int64_t m, int64_t D, int64_t keys, const bf16* p, int64_t ld, const bf16* vh,
                  float* o) {
#if defined(__AVX512BF16__)
  if (kernel == Products::kAvx512Bf16) {
    for (int64_t c0 = 0; c0 < keys; c0 += kValueChunk) {  // chunks start at key 0: the same sums for any block
      const int64_t pairs = std::min(kValueChunk, keys - c0) / 2;
      cpuserve_bf16dot::gemm(m, D, pairs, p + c0, ld, vh + c0 * D, D, o, D, c0 > 0);
    }
    return;
  }
#endif
  // one call over all keys: the accumulators stay in AMX tiles instead of being stored and reloaded per block
  at::native::cpublas::brgemm(m, D, keys, ld, D, D, false, p, vh, o, true);
}

// One key block of a kv head's values in VNNI pairs: dst[t/2][d][t%2] = src[t * ld + d] for t < n, zero for
// n <= t < kKeyBlock: two keys' rows interleaved, sixteen values of each per store.
void pack_values(const bf16* src, int64_t ld, int64_t n, int64_t D, bf16* dst) {
  for (int64_t t = 0; t < kKeyBlock; t += 2) {
    bf16* row = dst + t * D;  // pair t/2: D words
    int64_t d0 = 0;
#if defined(__AVX512F__)
    static const auto kInterleave = [] {  // word i of the result: value i of key t, then of key t + 1
      std::array<int16_t, 32> idx{};
      for (int i = 0; i < 16; ++i) idx[2 * i] = static_cast<int16_t>(i), idx[2 * i + 1] = static_cast<int16_t>(32 + i);
      return idx;
    }();
    const __m512i interleave = _mm512_loadu_si512(kInterleave.data());
    for (; d0 + 16 <= D; d0 += 16) {
      const auto load = [&](int64_t key) {
        const auto* part = reinterpret_cast<const __m256i*>(src + key * ld + d0);
        return key < n ? _mm512_castsi256_si512(_mm256_loadu_si256(part)) : _mm512_setzero_si512();
      };
      _mm512_storeu_si512(row + 2 * d0, _mm512_permutex2var_epi16(load(t), interleave, load(t + 1)));
    }
#endif
    for (int64_t d = d0; d < D; ++d) {
      row[2 * d] = t < n ? src[t * ld + d] : bf16(0.f);
      row[2 * d + 1] = t + 1 < n ? src[(t + 1) * ld + d] : bf16(0.f);
    }
  }
}

// out: contiguous [L, H, D] in q's dtype (a slice of o_proj's input buffer: the rows land where the next GEMM reads
// them, without a copy)
at::Tensor& slim_attention_out(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t q_start,
                               double sm_scale, int64_t block_rows, int64_t window,
                               const c10::optional<at::Tensor>& k_scale, at::Tensor& out) {
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == q.scalar_type() && out.sizes() == q.sizes(),
              "slim_attention: out must be a contiguous ", q.scalar_type(), " tensor of q's sizes ", q.sizes(),
              ", got ", out.scalar_type(), " ", out.sizes(), out.is_contiguous() ? "" : " (not contiguous)");
  if (q.scalar_type() == at::kFloat) {  // fp32 weights' activations: fp32 products, on AVX-512 alone
    TORCH_CHECK(!k_scale.has_value(), "slim_attention: an int8 k goes with bfloat16 q only");
    g_runs[3].fetch_add(1, std::memory_order_relaxed);
    return out.copy_(cpuserve_slim::slim_attention_fp32(q, k, v, q_start, sm_scale, block_rows, window));
  }
  const bool int8_keys = k.scalar_type() == at::kChar;
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && (int8_keys || k.scalar_type() == at::kBFloat16) &&
                  v.scalar_type() == at::kBFloat16,
              "slim_attention: q and v must be bfloat16 (or all three fp32), k bfloat16 or int8");
  TORCH_CHECK(int8_keys == k_scale.has_value(), "slim_attention: k_scale goes with an int8 k, and only with one");
  TORCH_CHECK(q.dim() == 3 && q.stride(-1) == 1 && q.stride(1) == q.size(2), "q must be [L, H, D] with dense rows");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous() && k.sizes() == v.sizes() && k.dim() == 3,
              "k and v must be contiguous [T, Hkv, D]");
  TORCH_CHECK(block_rows > 0, "block_rows must be positive, got ", block_rows);
  const Products kernel = product_kernel();
  TORCH_CHECK(kernel != Products::kNone, "slim_attention needs AMX or AVX512-BF16 (see slim_attention_kernel())");
  const int64_t L = q.size(0), H = q.size(1), D = q.size(2), T = k.size(0), Hkv = k.size(1);
  TORCH_CHECK(T == q_start + L, "k/v length ", T, " must equal q_start + L = ", q_start + L);
  TORCH_CHECK(k.size(2) == D && D % 2 == 0 && H % Hkv == 0, "head_dim must match and be even; Hkv must divide H");
  TORCH_CHECK(!int8_keys || slim_attention_int8_keys(), "slim_attention: an int8 k needs the avx512_bf16 kernel with "
              "AVX-512 VNNI (see slim_attention_int8_keys()); this CPU runs ", slim_attention_kernel());
  TORCH_CHECK(!int8_keys || (D % cpuserve_int8_scores::kQGroup == 0 && k_scale->scalar_type() == at::kFloat &&
                             k_scale->dim() == 2 && k_scale->size(0) == T && k_scale->size(1) == Hkv),
              "slim_attention: an int8 k needs head_dim a multiple of ", cpuserve_int8_scores::kQGroup, " (got ", D,
              ") and k_scale fp32 [T, Hkv]");
  g_runs[kernel == Products::kBrgemm ? 0 : int8_keys ? 2 : 1].fetch_add(1, std::memory_order_relaxed);
  const int64_t g = H / Hkv, nkb = (T + kKeyBlock - 1) / kKeyBlock, t_pad = nkb * kKeyBlock;
  // row stride of the score and P buffers: 64 elements past the keys, so consecutive rows do not sit a multiple
  // of 4 KiB apart (16 rows of one AMX tile load would then share one L1 set)
  const int64_t ld = t_pad + 64;
  const float scale = static_cast<float>(sm_scale);
  const bf16* vd = v.data_ptr<bf16>();

  // VNNI pairs: kp[h][kb][d/2][t][d%2] = k[t][h][d] (B = K^T), vp[h][kb][t/2][d][t%2] = v[t][h][d] (B = V); keys
  // past T are zero (they score 0, then are masked; P V reads zero rows)
  // int8 K: kp holds int8_scores.h's packed codes, u8 [h][kb][D/4][t][4], and ksp their scales [h][kb][t]
  auto kp = int8_keys ? at::empty({Hkv, nkb, D / 4, kKeyBlock, 4}, k.options().dtype(at::kByte))
                      : at::empty({Hkv, nkb, D / 2, kKeyBlock, 2}, k.options());
  auto ksp = at::empty({int8_keys ? Hkv * nkb * kKeyBlock : 0}, k.options().dtype(at::kFloat));
  auto vp = at::empty({Hkv, nkb, kKeyBlock / 2, D, 2}, v.options());
  bf16* vpd = vp.data_ptr<bf16>();
  auto* kpd = static_cast<uint8_t*>(kp.data_ptr());
  float* kspd = ksp.data_ptr<float>();
  const int64_t block_elems = kKeyBlock * D, k_block_bytes = block_elems * (int8_keys ? 1 : 2);  // per key block
  at::parallel_for(0, Hkv * nkb, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / nkb, kb = task % nkb, t0 = kb * kKeyBlock, n = std::min(kKeyBlock, T - t0);
      auto* packed = reinterpret_cast<uint32_t*>(kpd + task * k_block_bytes);
      if (int8_keys) {
        pack_keys(k.data_ptr<int8_t>() + (t0 * Hkv + h) * D, Hkv * D / 4, n, D / 4, 0x80808080u, packed);
        const float* scale = k_scale->data_ptr<float>() + t0 * k_scale->stride(0) + h * k_scale->stride(1);
        float* packed_scale = kspd + task * kKeyBlock;
        for (int64_t t = 0; t < kKeyBlock; ++t) packed_scale[t] = t < n ? scale[t * k_scale->stride(0)] : 0.f;
      } else {
        pack_keys(k.data_ptr<bf16>() + (t0 * Hkv + h) * D, Hkv * D / 2, n, D / 2, 0u, packed);
      }
      pack_values(vd + (t0 * Hkv + h) * D, Hkv * D, n, D, vpd + task * block_elems);
    }
  });

  const bf16* qd = q.data_ptr<bf16>();
  bf16* od = out.data_ptr<bf16>();
  const int64_t q_row = q.stride(0), num_row_blocks = (L + block_rows - 1) / block_rows;
  // A row block's work grows with its index, so a static split of the tasks would leave one thread with most of
  // it. Each thread takes the next task from a shared counter instead, longest row blocks first.
  const int64_t num_tasks = Hkv * num_row_blocks;
  cpuserve_tasks::share_tasks(num_tasks, [&](const auto& next) {
    const int64_t m_max = block_rows * g;
    // the thread's buffers, kept between calls and grown when a call needs more (a long prompt's stay, about 0.6 MB
    // a thread per 1000 keys): every element a task reads it has written first. Made and zeroed per call, they cost
    // a 128-token prompt's attention 7% on 2 threads (P's bf16 zeroed one element at a time).
    thread_local Scratch scratch;
    auto& [a, p, s, o, inv_sum, mx, qa, qscale, scaled_sums, starts, code_sums] = scratch;
    const int64_t groups = D / cpuserve_int8_scores::kQGroup;
    grow(a, int8_keys ? 0 : m_max * D), grow(p, m_max * ld), grow(s, m_max * ld), grow(o, m_max * D);
    grow(inv_sum, m_max), grow(mx, m_max);
    // int8 K: the rows' codes, their group scales and offsets (int8_scores.h)
    grow(qa, int8_keys ? m_max * D : 0), grow(qscale, int8_keys ? m_max * groups : 0), grow(scaled_sums, groups);
    grow(starts, int8_keys ? m_max : 0), grow(code_sums, groups);
    for (int64_t task; (task = next()) >= 0;) {
      const int64_t h = task % Hkv, rb = num_row_blocks - 1 - task / Hkv;
      const int64_t start = rb * block_rows, rows = std::min(block_rows, L - start), m = rows * g;
      const int64_t end_key = q_start + start + rows;  // keys past the block's last query are never seen
      // row i = r * g + j: query r, head h * g + j (int8 K: its codes, straight from q; else a bf16 copy)
      const auto q_of = [&](int64_t i) { return qd + (start + i / g) * q_row + (h * g + i % g) * D; };
      if (!int8_keys)
        for (int64_t r = 0; r < rows; ++r) std::memcpy(a.data() + r * g * D, q_of(r * g), g * D * sizeof(bf16));
#if defined(CPUSERVE_VNNI)
      if (int8_keys)
        for (int64_t i = 0; i < m; ++i) {
          float* qs = qscale.data() + i * groups;
          cpuserve_act::quantize_row(q_of(i), D, cpuserve_int8_scores::kQGroup, qa.data() + i * D, qs);
          cpuserve_act::group_sums(qa.data() + i * D, qs, D, cpuserve_int8_scores::kQGroup,
                                   cpuserve_int8_scores::kQGroup, scaled_sums.data(), code_sums.data());
          starts[i] = 0.f;  // what the keys' + 128 adds to the row's scores: 128 * sum over groups of scale * code sum
          for (int64_t grp = 0; grp < groups; ++grp) starts[i] -= 128.f * scaled_sums[grp];
        }
#endif
      const int64_t blocks = (end_key + kKeyBlock - 1) / kKeyBlock;
      // first key of row i (0 without a window); key blocks before the block's first row's first key are skipped
      const auto first_key = [&](int64_t i) {
        return window > 0 ? std::max<int64_t>(0, q_start + start + i / g + 1 - window) : int64_t{0};
      };
      const int64_t kb0 = first_key(0) / kKeyBlock;
      std::fill(mx.begin(), mx.begin() + m, -INFINITY);
      for (int64_t kb = kb0; kb < blocks; ++kb) {
        const int64_t seen = std::min(kKeyBlock, end_key - kb * kKeyBlock), block = h * nkb + kb;
        if (int8_keys) {
#if defined(CPUSERVE_VNNI)
          cpuserve_int8_scores::scores(m, seen, D, qa.data(), qscale.data(), starts.data(), kpd + block * k_block_bytes,
                                       kKeyBlock, kspd + block * kKeyBlock, s.data() + kb * kKeyBlock, ld);
#endif
        } else {
          score_block(kernel, m, D, a.data(), reinterpret_cast<const bf16*>(kpd + block * k_block_bytes),
                      s.data() + kb * kKeyBlock, ld, seen);
        }
        for (int64_t i = 0; i < m; ++i) {  // row maxima while the block's scores are still in cache
          const int64_t valid = std::min(q_start + start + i / g + 1 - kb * kKeyBlock, kKeyBlock);
          const int64_t lo = std::max<int64_t>(first_key(i) - kb * kKeyBlock, 0);
          if (valid > lo) mx[i] = row_max(s.data() + i * ld + kb * kKeyBlock + lo, valid - lo, mx[i]);
        }
      }
      for (int64_t i = 0; i < m; ++i) {
        const int64_t valid = q_start + start + i / g + 1, lo = first_key(i);
        bf16* pi = p.data() + i * ld;
        std::fill(pi + kb0 * kKeyBlock, pi + lo, bf16(0.f));
        inv_sum[i] = softmax_row(s.data() + i * ld + lo, valid - lo, blocks * kKeyBlock - lo, mx[i], scale, pi + lo,
                                 store_bf16);
      }
      // P V over all the row block's keys: the packed V blocks of a head are consecutive, so they read as one
      // [keys / 2][D][2] matrix (avx512_bf16 stops at the first pair past the block's last key, brgemm runs on to
      // the end of its key block)
      const int64_t keys = (kernel == Products::kBrgemm ? blocks * kKeyBlock : (end_key + 1) / 2 * 2) - kb0 * kKeyBlock;
      weigh_values(kernel, m, D, keys, p.data() + kb0 * kKeyBlock, ld, vpd + (h * nkb + kb0) * block_elems, o.data());
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < g; ++j) {
          bf16* dst = od + ((start + r) * H + h * g + j) * D;
          const float* src = o.data() + (r * g + j) * D;
          const float inv = inv_sum[r * g + j];
          for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<bf16>(src[d] * inv);
        }
    }
    if (kernel == Products::kBrgemm) at::native::cpublas::brgemm_release(true);
  });
  return out;
}

at::Tensor slim_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t q_start,
                          double sm_scale, int64_t block_rows, int64_t window,
                          const c10::optional<at::Tensor>& k_scale) {
  auto out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  return slim_attention_out(q, k, v, q_start, sm_scale, block_rows, window, k_scale, out);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cpuserve, m) {
  m.def("slim_attention(Tensor q, Tensor k, Tensor v, int q_start, float sm_scale, int block_rows, int window=0, "
        "Tensor? k_scale=None) -> Tensor");
  m.def("slim_attention.out(Tensor q, Tensor k, Tensor v, int q_start, float sm_scale, int block_rows, int window=0, "
        "Tensor? k_scale=None, *, Tensor(a!) out) -> Tensor(a!)");
  m.def("slim_attention_kernel() -> str");
  m.def("slim_attention_int8_keys() -> bool");
  m.def("slim_attention_products(str mode=\"\") -> str");
  m.def("slim_attention_runs() -> int[]");
  m.def("slim_attention_fp32() -> bool");
}

TORCH_LIBRARY_IMPL(cpuserve, CPU, m) {
  m.impl("slim_attention", &slim_attention);
  m.impl("slim_attention.out", &slim_attention_out);
}

TORCH_LIBRARY_IMPL(cpuserve, CompositeExplicitAutograd, m) {
  m.impl("slim_attention_kernel", &slim_attention_kernel);
  m.impl("slim_attention_int8_keys", &slim_attention_int8_keys);
  m.impl("slim_attention_products", &slim_attention_products);
  m.impl("slim_attention_runs", &slim_attention_runs);
  m.impl("slim_attention_fp32", &slim_attention_fp32);
}
