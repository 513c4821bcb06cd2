// Prompt rows on AMX-BF16: a layer's codes (vnni_layouts.h: 4-, 6- or 8-bit, every scale form) dequantized to bf16
// once per call and column tile, bf16 activations as they come, fp32 sums kept in the tiles over all of K.
//
// Why not the int8 path's tiles (vnni_amx_rows.h amx_rows): their per-group epilogue needs each weight group's int32
// sums out of the tiles, 1 KB per 16 x 16 x 32 multiply-adds, and tile stores cap that at about a third of the
// TMUL's rate (measured on a 2-core Xeon with AMX: 340 G multiply-adds a second a core at best, 170 in registers).
// Here the group scales are folded into the weights before the tiles see them, so nothing leaves a tile until K is
// done: 560-640 G multiply-adds a second a core on the same CPU, dequantization included.
//
// Where x outgrows L2 (a 3B model's 512-token prompt: 3 MB at K = 3072) the rows, not the weights, set the pace:
// going through x once per column pair, the tiles waited on L3 (~23 GB/s a core). So a task is a panel of column
// blocks (as many as fit the L2 budget beside 32 rows of x), each 32 rows go through every pair of the panel, x is
// packed in tile order once per call and the next 32 rows are prefetched meanwhile; K goes in spans of at most 2048
// inputs (the sums leave the tiles between spans, in fp32, exactly) so that panels stay wide when K is large.
// 512 x 3072 -> 8192 went from ~570 to ~870 G multiply-adds a second on 2 cores, 512 x 8192 -> 3072 from ~620 to
// ~820 (oneDNN's bf16 matmul: ~570-660, same runs).
//
// The bits are those of a row alone: each output element is one tile lane's fp32 sum over K in increasing order,
// whatever the row count, the row block, the thread or the batch (rows past the last whole 16 are computed in a
// zero-padded block). They are not the int8 path's bits, so the engine takes this path by a row's role (a prompt
// token), never by the batch's size (engine/layers/linear/base.py). Quality: bf16 activations instead of int8 groups.
//
//   w[n, k] = bf16(code * scale + zoff)            per weight group, fp32 then rounded to nearest even
//           = bf16((code - z) * scale * 2^-e)      symmetric codes
//   y[m, n] = bf16(sum over k of x[m, k] * w[n, k])  fp32 sums in TDPBF16PS's order
// engine/layers/linear/act_int8.py's prompt_reference is the plain-torch reference.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "amx_tiles.h"
#include "int8_gemm_operands.h"
#include "ops.h"
#include "simd.h"
#include "tasks.h"
#include "vnni_layouts.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#if defined(CPUSERVE_VNNI) && defined(__AVX512BF16__)
#define CPUSERVE_AMX_BF16 1
#endif

namespace {

using bf16 = at::BFloat16;
constexpr int64_t kStepInputs = 32;  // inputs per TDPBF16PS: 16 bf16 pairs

// 0 off, 1 the instructions (AmxHw), 2 their software model (AmxEmu: tests); -1 until first asked: the
// instructions where the CPU and Linux give them, unless CPUSERVE_AMX=off
std::atomic<int> g_mode{-1};

int bf16_mode() {
  int mode = g_mode.load();
  if (mode < 0) {
    const char* env = std::getenv("CPUSERVE_AMX");
    const bool off = env != nullptr && std::string(env) == "off";
#if defined(CPUSERVE_AMX_BF16)
    const int want = !off && cpuserve_amx::amx_bf16_hw_available() ? 1 : 0;
#else
    const int want = 0;
#endif
    g_mode.compare_exchange_strong(mode, want);
    mode = g_mode.load();
  }
  return mode;
}

#if defined(CPUSERVE_AMX_BF16)
using cpuserve_vnni::Codes;
using cpuserve_vnni::StoredScales;
using cpuserve_vnni::SuperScales;

// The tiles: sums of 2 row blocks x 2 column blocks (tmm0-3), 16 rows of activations each (tmm4, tmm5), the weights
// of 2 column blocks (tmm6, tmm7), each 16 rows of 64 bytes
cpuserve_amx::TileConfig tile_config() {
  cpuserve_amx::TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.set(t, 16, 64);
  return cfg;
}

template <int Bits, typename Scales>
struct PromptGemm {
  using W = Codes<Bits>;
  const bf16* x;        // [M, K]
  const uint8_t* w;     // packed codes
  Scales scales;
  bool symmetric;
  int32_t z;            // the symmetric form's zero code
  float unscale;        // its 2^-e
  int64_t K, S, N;
  bf16* out;
  int64_t ldo;
  bool silu = false;    // the columns are [gate | up]: out [M, N / 2] gets silu(gate) * up (gate_up_silu)

  // Column block b's weights for inputs [k0, k1) as B tiles: [(k1 - k0) / 2][16 columns x a bf16 pair] at dst, pair p
  // holding inputs k0 + 2p, k0 + 2p + 1
  void dequantize(int64_t b, uint16_t* dst, int64_t k0, int64_t k1) const {
    const __m512i byte = _mm512_set1_epi32(255);
    // cvtne2ps gives 16 bf16 of the even input, then 16 of the odd; the permutation interleaves them per column
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                           21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const int64_t group = K / S;
    const uint8_t* src = w + b * K * 2 * Bits;
    for (int64_t k = k0; k < k1; k += W::kStep) {
      const int64_t g = k / group;
      const __m512 sv = symmetric ? _mm512_mul_ps(scales.scale(b, g), _mm512_set1_ps(unscale)) : scales.scale(b, g);
      const __m512 zv = symmetric ? _mm512_setzero_ps() : scales.zoff(b, g);
      __m512i wk[W::kOps];
      W::load(src + k * 2 * Bits, wk);
      for (int i = 0; i < W::kOps; ++i) {  // inputs k + 4i .. k + 4i + 3: byte j of column c's lane
        __m512 v[4];
        for (int j = 0; j < 4; ++j) {
          __m512i code = _mm512_and_si512(_mm512_srli_epi32(wk[i], 8 * j), byte);
          if (symmetric) code = _mm512_sub_epi32(code, _mm512_set1_epi32(z));
          v[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(code), sv, zv);  // symmetric: + 0, exact
        }
        for (int p = 0; p < 2; ++p) {
          const __m512i two = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(v[2 * p + 1], v[2 * p]));
          _mm512_store_si512(dst + ((k - k0 + 4 * i) / 2 + p) * 32, _mm512_permutexvar_epi16(pairs, two));
        }
      }
    }
  }

  // Sums tile c (of two row blocks x two column blocks) to bf16 rows m.. of column block b (`rows` of them)
  template <typename Tiles, int C>
  static void store_sums(float* scratch, bf16* dst, int64_t ldo, int64_t rows) {
    Tiles::template store<C>(scratch, 64);
    for (int64_t r = 0; r < rows; ++r)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + r * ldo),
                          cpuserve_simd::to_bf16_exact(_mm512_load_ps(scratch + r * 16)));
  }

  // Sums tiles G (gate) and U (up) each rounded to bf16, as gate_up's output would hold them, then silu(g) * u to
  // bf16 rows m.. of an output column block: decode_ops.cpp's silu_mul arithmetic, instruction for instruction
  template <typename Tiles, int G, int U>
  static void store_silu(float* scratch, bf16* dst, int64_t ldo, int64_t rows) {
    Tiles::template store<G>(scratch, 64);
    Tiles::template store<U>(scratch + 256, 64);
    const auto rounded = [](__m512 v) {
      const __m512i wide = _mm512_cvtepu16_epi32(cpuserve_simd::to_bf16_exact(v));
      return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
    };
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 g = rounded(_mm512_load_ps(scratch + r * 16)), u = rounded(_mm512_load_ps(scratch + 256 + r * 16));
      const __m512 e = cpuserve_simd::exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
      const __m512 act = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e));
      cpuserve_simd::store16(dst + r * ldo, _mm512_mul_ps(act, u));
    }
  }

  // Rows as a rows block reads them: packed (pack_rows) or x's own rows
  struct RowLayout {
    int64_t step_elems, stride_bytes;  // an A tile's offset per input, its rows' stride
  };
  // A part of K: inputs [k0, k1), the panel's weights for it at slab (a block's every slab_stride), and whether the
  // sums start there (else they come back from acc) and end there (else they go to acc)
  struct Span {
    int64_t k0, k1, slab_stride;
    bool first, last;
  };
  // Lines to fetch into L2 while a rows block runs: [from, to) of `lines` lines at seg[0], then as many at seg[1]
  struct Ahead {
    const char* seg[2] = {nullptr, nullptr};
    int64_t lines = 0, from = 0, to = 0;
  };

  // Rows a (16) and, when two, a2 (16 more) through the column pair's blocks (n of them) from the B tiles at slab,
  // over the span's inputs; acc holds the four tiles' sums between spans
  template <typename Tiles>
  void rows_block(const uint16_t* a, const uint16_t* a2, RowLayout layout, const uint16_t* slab, int n, Span span,
                  float* acc, bf16* dst, bf16* dst2, int64_t rows, int64_t rows2, float* scratch, Ahead ahead) const {
    if (span.first) {
      Tiles::template zero<0>(), Tiles::template zero<1>(), Tiles::template zero<2>(), Tiles::template zero<3>();
    } else {
      Tiles::template load<0>(acc, 64), Tiles::template load<1>(acc + 256, 64);
      Tiles::template load<2>(acc + 512, 64), Tiles::template load<3>(acc + 768, 64);
    }
    const uint16_t* slab1 = slab + span.slab_stride;
    const int64_t steps = (span.k1 - span.k0) / kStepInputs;
    const int64_t per_step = std::min<int64_t>(4, (ahead.to - ahead.from + steps - 1) / steps);
    for (int64_t k = span.k0, step = 0; k < span.k1; k += kStepInputs, ++step) {
      for (int64_t l = ahead.from + step * per_step, last = std::min(l + per_step, ahead.to); l < last; ++l)
        _mm_prefetch(ahead.seg[l / ahead.lines] + l % ahead.lines * 64, _MM_HINT_T1);
      const int64_t kb = (k - span.k0) * 16;
      Tiles::template load<4>(a + k * layout.step_elems, layout.stride_bytes);
      Tiles::template load<6>(slab + kb, 64);
      Tiles::template dpbf16ps<0, 4, 6>();
      if (n == 2) Tiles::template load<7>(slab1 + kb, 64), Tiles::template dpbf16ps<1, 4, 7>();
      if (a2 == nullptr) continue;
      Tiles::template load<5>(a2 + k * layout.step_elems, layout.stride_bytes);
      Tiles::template dpbf16ps<2, 5, 6>();
      if (n == 2) Tiles::template dpbf16ps<3, 5, 7>();
    }
    if (!span.last) {  // fp32 sums out and back in exactly: the next span goes on adding to the same values
      Tiles::template store<0>(acc, 64), Tiles::template store<1>(acc + 256, 64);
      Tiles::template store<2>(acc + 512, 64), Tiles::template store<3>(acc + 768, 64);
      return;
    }
    if (silu) {  // n == 2: gate and up
      store_silu<Tiles, 0, 1>(scratch, dst, ldo, rows);
      if (a2 != nullptr) store_silu<Tiles, 2, 3>(scratch, dst2, ldo, rows2);
      return;
    }
    store_sums<Tiles, 0>(scratch, dst, ldo, rows);
    if (n == 2) store_sums<Tiles, 1>(scratch, dst + 16, ldo, rows);
    if (a2 == nullptr) return;
    store_sums<Tiles, 2>(scratch, dst2, ldo, rows2);
    if (n == 2) store_sums<Tiles, 3>(scratch, dst2 + 16, ldo, rows2);
  }

  // Every row through a panel of column blocks whose bf16 weights for the span's inputs are at slab, two blocks a
  // pair (with silu a gate block and its up block); `blocks` of them, the panel's first output block b0. Each 32
  // rows (then 16) go through every pair of the panel while they are in the core's L2, so x streams from memory
  // once per panel, not once per pair. Rows packed (xp: pack_rows; the next 32 rows' span fetched into L2
  // meanwhile) or, with xp null, x's own rows, the last ones zero-padded. acc: the sums between spans, 4 tiles per
  // 16-row start and pair.
  template <typename Tiles>
  void panel(int64_t M, const uint16_t* xp, int64_t b0, int blocks, const uint16_t* slab, Span span, float* acc,
             bf16* padded) const {
    alignas(64) float scratch[2 * 16 * 16];  // sums tiles on their way to bf16
    const int pairs = (blocks + 1) / 2;
    const auto through = [&](const uint16_t* a, const uint16_t* a2, RowLayout layout, int64_t m, int64_t rows,
                             int64_t rows2, Ahead ahead) {
      const int64_t total = ahead.to, share = (total + pairs - 1) / pairs;
      for (int p = 0; 2 * p < blocks; ++p) {
        const int n = std::min(2, blocks - 2 * p);
        const int64_t col = (silu ? b0 + p : b0 + 2 * p) * 16;
        ahead.from = std::min(total, p * share), ahead.to = std::min(total, ahead.from + share);
        rows_block<Tiles>(a, a2, layout, slab + 2 * p * span.slab_stride, n, span, acc + (m / 16 * pairs + p) * 1024,
                          out + m * ldo + col, a2 != nullptr ? out + (m + 16) * ldo + col : nullptr, rows, rows2,
                          scratch, ahead);
      }
    };
    if (xp != nullptr) {
      const int64_t padded_rows = (M + 15) / 16 * 16;
      for (int64_t m = 0; m < M; m += 32) {
        const int64_t rows = std::min<int64_t>(16, M - m), rows2 = std::clamp<int64_t>(M - m - 16, 0, 16);
        const uint16_t* a = xp + m * K;
        Ahead ahead;  // the span of the next 32 rows: a piece of each of their two blocks
        ahead.lines = (span.k1 - span.k0) / 2;
        for (int h = 0; h < 2 && m + 32 + 16 * h < padded_rows; ++h, ahead.to += ahead.lines)
          ahead.seg[h] = reinterpret_cast<const char*>(xp + (m + 32 + 16 * h) * K + span.k0 * 16);
        through(a, rows2 > 0 ? a + 16 * K : nullptr, {16, 64}, m, rows, rows2, ahead);
      }
      return;
    }
    const auto* rows_of = reinterpret_cast<const uint16_t*>(x);
    const RowLayout plain{1, K * 2};
    int64_t m = 0;
    for (; m + 32 <= M; m += 32) through(rows_of + m * K, rows_of + (m + 16) * K, plain, m, 16, 16, {});
    for (; m + 16 <= M; m += 16) through(rows_of + m * K, nullptr, plain, m, 16, 0, {});
    if (m == M) return;
    if (span.first) {
      std::copy(x + m * K, x + M * K, padded);
      std::fill(padded + (M - m) * K, padded + 16 * K, bf16(0.f));
    }
    through(reinterpret_cast<const uint16_t*>(padded), nullptr, plain, m, M - m, 0, {});
  }

  // x in the order the tiles read it: per 16 rows (the last block zero-padded), per step of 32 inputs, the 16 rows'
  // 64 bytes one after another: each A tile is 1 KB in one piece, and a row block's tiles one stream the hardware
  // prefetcher follows (rows of x are K * 2 bytes apart: 16 or 32 strided streams, more than it tracks)
  void pack_rows(int64_t M, uint16_t* xp) const {
    const int64_t blocks = (M + 15) / 16;
    const auto* src = reinterpret_cast<const uint16_t*>(x);
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b)
        for (int64_t r = 0; r < 16; ++r) {
          const int64_t m = b * 16 + r;
          uint16_t* dst = xp + b * 16 * K + r * kStepInputs;
          for (int64_t k = 0; k < K; k += kStepInputs) {
            const __m512i v = m < M ? _mm512_loadu_si512(src + m * K + k) : _mm512_setzero_si512();
            _mm512_store_si512(dst + k * 16, v);
          }
        }
    });
  }

  // Inputs a span: K in equal parts of at most kSpanInputs, each a multiple of 256 (a K-quant super-block), so a
  // panel's weights and a 32-row block's inputs stay small enough for wide panels when K is large (2048 measured
  // best of 1024, 2048, 4096 and none at a 3B model's shapes: the down projection, K = 8192, +11% over 4096)
  static constexpr int64_t kSpanInputs = 2048;
  int64_t span_inputs() const {
    const int64_t spans = (K + kSpanInputs - 1) / kSpanInputs;
    return std::min(K, ((K + spans - 1) / spans + 255) / 256 * 256);
  }

  // Column blocks a panel: as many as keep its bf16 weights over a span and a 32-row block of x's span within
  // about 1 MB of the core's L2 (measured on a Xeon with AMX, 2 MB of L2 a core: more thrashes it), at least a
  // pair, and few enough that every thread gets about four panels. When x itself fits in L2 a pair is enough,
  // except for the fused silu, whose tasks are wide (a gate and its up block): at SmolLM2's 512 x 576 -> 3072 it ran
  // ~600 G multiply-adds a second on pairs and ~800 on panels (2 cores of a Xeon with AMX); the plain GEMMs at its
  // shapes did not gain.
  int64_t panel_blocks(int64_t M, int64_t span) const {
    constexpr int64_t kBudget = int64_t{1} << 20;
    const int64_t threads = at::get_num_threads(), total = N / 16;
    if (M * K * 2 <= kBudget && !silu) return 2;
    const int64_t by_cache = std::max<int64_t>(0, kBudget - 32 * span * 2) / (span * 16 * 2);
    return std::max<int64_t>(2, std::min(by_cache, total / (4 * threads)) / 2 * 2);
  }

  void run(int64_t M, int mode) const {
    // a task: a panel of P column blocks (P / 2 gate blocks and their up blocks with silu), span after span of K
    const int64_t Ks = span_inputs(), P = panel_blocks(M, Ks), blocks = N / 16;
    const int64_t tasks = silu ? (blocks / 2 + P / 2 - 1) / (P / 2) : (blocks + P - 1) / P;
    // x packed when a panel has more than one pair: kept between calls
    thread_local std::vector<uint16_t> packed;
    uint16_t* xp = nullptr;
    if (P > 2) {
      const int64_t rows = (M + 15) / 16 * 16;
      if (static_cast<int64_t>(packed.size()) < rows * K + 32) packed.resize(rows * K + 32);
      xp = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(packed.data()) + 63) & ~uintptr_t{63});
      pack_rows(M, xp);
    }
    cpuserve_tasks::share_tasks(tasks, [&](const auto& next) {
      // per thread, kept between calls: the panel's weights over a span as bf16, a padded row block, the sums
      // between spans
      thread_local std::vector<uint16_t> slab;
      thread_local std::vector<bf16> padded;
      thread_local std::vector<float> acc;
      if (static_cast<int64_t>(slab.size()) < P * Ks * 16 + 32) slab.resize(P * Ks * 16 + 32);
      if (xp == nullptr && static_cast<int64_t>(padded.size()) < 16 * K) padded.resize(16 * K);
      const int64_t acc_floats = Ks < K ? (M / 16 + 1) * (P / 2) * 1024 + 16 : 16;
      if (static_cast<int64_t>(acc.size()) < acc_floats) acc.resize(acc_floats);
      // 64-byte aligned for the tiles' loads and stores (the vectors' own alignment is 2 or 4)
      auto* aligned = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(slab.data()) + 63) & ~uintptr_t{63});
      auto* sums = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(acc.data()) + 63) & ~uintptr_t{63});
      const auto each = [&](auto tiles_kind) {
        using Tiles = decltype(tiles_kind);
        Tiles::config(tile_config());
        for (int64_t t; (t = next()) >= 0;) {
          for (int64_t k0 = 0; k0 < K; k0 += Ks) {
            const int64_t k1 = std::min(K, k0 + Ks), width = (k1 - k0) * 16;
            const Span span{k0, k1, width, k0 == 0, k1 == K};
            if (silu) {
              const int64_t g0 = t * (P / 2);
              const int gates = static_cast<int>(std::min<int64_t>(P / 2, blocks / 2 - g0));
              for (int g = 0; g < gates; ++g) {
                dequantize(g0 + g, aligned + 2 * g * width, k0, k1);
                dequantize(g0 + g + N / 32, aligned + (2 * g + 1) * width, k0, k1);
              }
              panel<Tiles>(M, xp, g0, 2 * gates, aligned, span, sums, padded.data());
              continue;
            }
            const int64_t b0 = t * P;
            const int n = static_cast<int>(std::min<int64_t>(P, blocks - b0));
            for (int c = 0; c < n; ++c) dequantize(b0 + c, aligned + c * width, k0, k1);
            panel<Tiles>(M, xp, b0, n, aligned, span, sums, padded.data());
          }
        }
        Tiles::release();
      };
      if (mode == 1) return each(cpuserve_amx::AmxHw{});
      each(cpuserve_amx::AmxEmu{});
    });
  }
};
#endif

bool amx_bf16_gemm_supported() { return bf16_mode() != 0; }

// x [M, K] bf16 and the operands of vnni_gemm (vnni_layouts.h) -> out [M, N] bf16, rows of any stride
at::Tensor& prompt_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                        const at::Tensor& zoffs, int64_t bits, int64_t act_group,
                        const c10::optional<at::Tensor>& supers, at::Tensor& out, bool silu) {
  const int mode = bf16_mode();
  TORCH_CHECK(mode != 0, "amx_bf16_gemm needs AMX-BF16 (this CPU or its build has none, or CPUSERVE_AMX=off)");
  const int64_t N = packed.size(0) * 16, K = packed.size(1) * 32 / bits, M = x.size(0);
  if (silu) {  // the operands' checks against an output of the GEMM's shape (a meta tensor: no memory), then out's
    TORCH_CHECK(N % 32 == 0, "amx_bf16_gemm_silu: N=", N, " must be [gate | up], each a multiple of 16 columns");
    const auto full = at::empty({M, N}, x.options().device(at::kMeta));
    cpuserve_ops::check_gemm_operands(x, packed, scales, zoffs, bits, act_group, supers, full);
    TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.sizes() == at::IntArrayRef({M, N / 2}) &&
                    out.stride(1) == 1 && out.stride(0) >= N / 2,
                "out must be bf16 [", M, ", ", N / 2, "] with contiguous rows, got ", out.scalar_type(), " ",
                out.sizes(), " strides ", out.strides());
  } else {
    cpuserve_ops::check_gemm_operands(x, packed, scales, zoffs, bits, act_group, supers, out);
  }
  TORCH_CHECK(K % kStepInputs == 0, "amx_bf16_gemm: K=", K, " must be a multiple of ", kStepInputs);
#if defined(CPUSERVE_AMX_BF16)
  const bool symmetric = zoffs.scalar_type() == at::kInt;
  const int32_t* header = symmetric ? zoffs.data_ptr<int32_t>() : nullptr;
  const int64_t S = scales.size(1);
  const auto widths = [&](auto form) {
    using Scales = decltype(form);
    const auto go = [&](auto gemm) {
      gemm.x = x.data_ptr<bf16>(), gemm.w = packed.data_ptr<uint8_t>(), gemm.scales = form;
      gemm.symmetric = symmetric, gemm.z = symmetric ? header[0] : 0;
      gemm.unscale = symmetric ? std::ldexp(1.f, -header[1]) : 1.f;
      gemm.K = K, gemm.S = S, gemm.N = N, gemm.out = out.data_ptr<bf16>(), gemm.ldo = out.stride(0);
      gemm.silu = silu;
      gemm.run(M, mode);
    };
    if (bits == 4) return go(PromptGemm<4, Scales>{});
    if (bits == 6) return go(PromptGemm<6, Scales>{});
    if constexpr (!Scales::kFactored) go(PromptGemm<8, Scales>{});
  };
  if (supers.has_value()) {
    const uint8_t* mins = symmetric ? nullptr : zoffs.data_ptr<uint8_t>();
    const int64_t shift = __builtin_ctzll(S / supers->size(1)), F = supers->size(2);
    const auto* sup = supers->data_ptr<at::Half>();
    cpuserve_int8::with_super_scales<SuperScales>(scales.scalar_type() == at::kByte, symmetric, [&](auto form) {
      using Factored = decltype(form);
      widths(Factored{static_cast<decltype(Factored::sub)>(scales.data_ptr()), mins, sup, S, shift, F});
    });
  } else if (scales.scalar_type() == at::kHalf) {
    widths(StoredScales<at::Half>{scales.data_ptr<at::Half>(), symmetric ? nullptr : zoffs.data_ptr<at::Half>(), S, 0});
  } else {
    widths(StoredScales<float>{scales.data_ptr<float>(), symmetric ? nullptr : zoffs.data_ptr<float>(), S, 0});
  }
#endif
  return out;
}

// x [M, K] bf16 and the operands of vnni_gemm (vnni_layouts.h) -> out [M, N] bf16, rows of any stride
at::Tensor& amx_bf16_gemm_out(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                              const at::Tensor& zoffs, int64_t bits, int64_t act_group,
                              const c10::optional<at::Tensor>& supers, at::Tensor& out) {
  return prompt_gemm(x, packed, scales, zoffs, bits, act_group, supers, out, false);
}

// The same with the columns [gate | up] -> out [M, N / 2] = silu(gate) * up, the bits of silu_mul over
// amx_bf16_gemm's output (a prompt's MLP without its [M, N] intermediate)
at::Tensor& amx_bf16_gemm_silu_out(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                                   const at::Tensor& zoffs, int64_t bits, int64_t act_group,
                                   const c10::optional<at::Tensor>& supers, at::Tensor& out) {
  return prompt_gemm(x, packed, scales, zoffs, bits, act_group, supers, out, true);
}

at::Tensor amx_bf16_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                         const at::Tensor& zoffs, int64_t bits, int64_t act_group,
                         const c10::optional<at::Tensor>& supers) {
  auto out = at::empty({x.size(0), packed.size(0) * 16}, x.options());
  return amx_bf16_gemm_out(x, packed, scales, zoffs, bits, act_group, supers, out);
}

// mode "off", "auto" (the instructions where the CPU and Linux give them) or "emulate" (their software model:
// tests), or "" to keep it; returns the mode in force: "off", "hw" or "emulate"
std::string amx_bf16_gemm_mode(const std::string& mode) {
  TORCH_CHECK(mode.empty() || mode == "off" || mode == "auto" || mode == "emulate",
              "amx_bf16_gemm_mode: mode must be off, auto or emulate, got ", mode);
#if defined(CPUSERVE_AMX_BF16)
  if (mode == "off") g_mode = 0;
  if (mode == "emulate") g_mode = 2;
  if (mode == "auto") g_mode = cpuserve_amx::amx_bf16_hw_available() ? 1 : 0;
#else
  TORCH_CHECK(mode.empty() || mode == "off", "amx_bf16_gemm_mode(", mode, "): this build has no AVX-512 BF16");
#endif
  static const char* const kNames[] = {"off", "hw", "emulate"};
  return kNames[bf16_mode()];
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cpuserve, m) {
  m.def("amx_bf16_gemm(Tensor x, Tensor packed, Tensor scales, Tensor zoffs, int bits, int act_group, "
        "Tensor? supers=None) -> Tensor");
  m.def("amx_bf16_gemm.out(Tensor x, Tensor packed, Tensor scales, Tensor zoffs, int bits, int act_group, "
        "Tensor? supers=None, *, Tensor(a!) out) -> Tensor(a!)");
  m.def("amx_bf16_gemm_silu.out(Tensor x, Tensor packed, Tensor scales, Tensor zoffs, int bits, int act_group, "
        "Tensor? supers=None, *, Tensor(a!) out) -> Tensor(a!)");
  m.def("amx_bf16_gemm_supported() -> bool");
  m.def("amx_bf16_gemm_mode(str mode=\"\") -> str");
}

TORCH_LIBRARY_IMPL(cpuserve, CPU, m) {
  m.impl("amx_bf16_gemm", &amx_bf16_gemm);
  m.impl("amx_bf16_gemm.out", &amx_bf16_gemm_out);
  m.impl("amx_bf16_gemm_silu.out", &amx_bf16_gemm_silu_out);
}

TORCH_LIBRARY_IMPL(cpuserve, CompositeExplicitAutograd, m) {
  m.impl("amx_bf16_gemm_supported", &amx_bf16_gemm_supported);
  m.impl("amx_bf16_gemm_mode", &amx_bf16_gemm_mode);
}
