// int4 / int6 / int8 weights x dynamic int8 activations with integer dot products (AVX-512 VNNI vpdpbusd), with
// out=. The AVX2 levels' build runs the same op over avx2_gemm.h's register blocks (the same bits).
//
// The bf16 kernels (int4_gemm.cpp, int8_gemm.cpp) dequantize weights to fp32 and run FMAs: 16 multiply-adds per
// instruction. vpdpbusd does 64 (16 lanes x 4 byte pairs), so once activations are int8 (act_quant.h, each row on
// its own) the same units do 4x the work, and weights never leave their packed bytes.
//
// The packed layouts of codes, scales, zoffs and supers: vnni_layouts.h.
//
// Per activation group g (act_group inputs; x ~= ax[g] * q, axs[g] = ax[g] * sum of q over g, qs[g] that sum):
//     y += float(sum code * q) * scale * ax[g] + zoff * axs[g]                    (zoffs stored)
//     y += float(sum code * q - z * qs[g]) * (scale * ax[g])                      (symmetric: exact integer sum)
// With one scale per output channel the weights' terms come out of the sum: per group only
//     y' += float(sum code * q) * ax[g],   then once   y = y' * scale + zoff * (sum over g of axs[g]).
// vpdpbusd and the fp32 multiplies share Zen 4's two 512-bit pipes (measured: 8 vpdpbusd + 4 FMAs take 12 cycles),
// so every epilogue instruction saved per group is a dot product gained: the per-group form costs 3 of them per 8
// vpdpbusd (int4, groups of 32), the symmetric form 2 (the zero term starts the integer sum), the per-channel form 1,
// where an activation group spans several weight groups (a K-quant's super-block: block_nested) 2 or 1,
// and per-channel weights with one activation group a row (act_group = K: activations "int8-token", vLLM's W8A8
// scheme) none: the integer sum runs over all of K, then one epilogue (int32 holds it: |sum| <= 255 * 127 * K).
// Packing happens once at load (engine/layers/linear/act_int8.py, with the plain-torch reference). Integer sums
// are exact and each output element's epilogue runs in the same order (groups in k order) whatever the register
// block, task or thread that computes it: a row's result depends neither on the batch, the tiling nor the threads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "act_quant.h"
#include "amx_tiles.h"
#include "avx2_gemm.h"
#include "ops.h"
#include "simd.h"
#include "tasks.h"
#include "vnni_layouts.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

// The int8 GEMMs are built: on AVX-512 VNNI (the Gemm below) or on AVX2 (avx2_gemm.h's)
#if defined(CPUSERVE_VNNI) || defined(CPUSERVE_AVX2_GEMM)
#define CPUSERVE_INT8_GEMM 1
#endif

namespace {

using bf16 = at::BFloat16;
constexpr int64_t kPrefetch = 1024;  // bytes ahead in a column block's stream (tasks interleave between threads)
constexpr int64_t kQuantRowsPerTask = 8;
// The largest weight group whose code sums (at most 127 each) fit int16: block_nested's integer zero term
constexpr int64_t kInt16Group = 256;
// Register blocks beyond kFewRows rows: kRows rows x kCols column blocks, 12 int32 + 12 fp32 accumulators. One
// thread, SmolLM2's layer GEMMs at 512 rows, hot: 6 x 2 made 294-319 G multiply-adds a second, 5 x 2 293-314,
// 4 x 2 280-298, 4 x 3 271-297, 8 x 2 (spilling) 242-254.
constexpr int kCols = 2;
constexpr int kRows = 6;
// Up to kSmallRows rows (batched decode) the blocks are 4 rows x 2 column blocks: 32 rows as 6 x 5 + 2 made 279-353
// (qkv, o) and 396-465 (down, gate_up) G multiply-adds a second on 2 threads, as 4 x 8 378-460 and 452-547.
constexpr int64_t kSmallRows = 32;
constexpr int kSmallRowsBlock = 4;
// Up to kFewRows rows (decode) a task is one column block in register blocks of 8 rows x 1 block: one sequential
// stream of weights per thread, each loaded once for 8 rows. One thread, CPU time, SmolLM2's 30 layers of int4
// weights, against 4 rows x 2 blocks: 1.14-1.4x at 1-8 rows, 1.04-1.08x at 12-16,
// none at 32.
constexpr int64_t kFewRows = 16;
// Decode tasks per thread: each a run of adjacent column blocks, so a thread streams long sequential runs of weights
// and takes the shared counter (a cache line the threads pass back and forth) a few times per GEMM, not once per
// 16 columns
constexpr int64_t kDecodeTasksPerThread = 4;
// Up to kPairRows rows, 6-bit codes (Q6_K, the 5-bit types) go two column blocks a register block, two independent
// chains of dot products where one left their unpacking waiting on latencies: the 3B file's Q6_K GEMMs at one row,
// streamed from memory, 2 threads, alternating builds: v 80-86 -> 56-65 us, down 648-695 -> 465-501 us, the lm_head
// 8.4-8.8 -> 7.1-7.5 ms. 4-bit codes stay one block at a time (two streams made some of their GEMMs slower).
constexpr int kPairRows = 2;
// Beyond kFewRows rows, likewise (Gemm::tile_runs)
constexpr int64_t kTileRunsPerThread = 4;
// The int8 GEMMs take AMX tiles (Gemm::amx_rows) from this many rows: below it their per-group epilogue, the same as
// the register blocks', outweighs what the tiles save. One thread of a 2-core Xeon with AMX, SmolLM2's four layer
// GEMMs (Q4_1 codes), tiles against registers: 0.82-1.0x at 32 and 64 rows, 0.96-1.19x at 128, 1.03-1.15x at 256,
// 1.07-1.19x at 512. (Prompt rows take amx_bf16_gemm.cpp where the CPU has AMX-BF16: 2.8-3.5x at 512 rows.)
constexpr int64_t kAmxMinRows = 128;
// The per-token form (Gemm::token_form, vLLM's W8A8 scheme) has no per-group epilogue: its sums stay in the tiles over
// all of K, so the tiles take it from 32 rows (batched decode at 32 streams). 2 threads of the same Xeon, a 3B model's
// four layer GEMMs (K = 3072 and 8192), tiles against registers: 2.3x at 32 rows, 2.1x at 64, 2.7x at 96, 2.8x at 512.
constexpr int64_t kAmxTokenMinRows = 32;

using cpuserve_tasks::run_length;

// The AMX path (Gemm::amx_rows): 0 off, 1 the instructions (AmxHw), 2 their software model (AmxEmu, for tests).
// -1 until first asked: the instructions where the CPU and Linux give them, unless CPUSERVE_AMX=off.
std::atomic<int> g_amx{-1};
std::atomic<int64_t> g_amx_blocks{0};  // 16-row blocks computed on tiles (AMX or the model), for the tests
std::atomic<int64_t> g_runs{0};        // calls of vnni_gemm_out, for the tests (which kernels the layers use)

int amx_mode() {
#if !defined(CPUSERVE_VNNI)
  return 0;  // the tiles belong to the AVX-512 build
#endif
  int mode = g_amx.load();
  if (mode < 0) {
    const char* env = std::getenv("CPUSERVE_AMX");
    const bool off = env != nullptr && std::string(env) == "off";
    int want = !off && cpuserve_amx::amx_hw_available() ? 1 : 0;
    g_amx.compare_exchange_strong(mode, want);
    mode = g_amx.load();
  }
  return mode;
}

bool vnni_gemm_supported() {
#if defined(CPUSERVE_INT8_GEMM)
  return true;
#else
  return false;
#endif
}

#if defined(CPUSERVE_VNNI)
using cpuserve_simd::load16;
using cpuserve_simd::to_bf16_exact;
using cpuserve_vnni::Codes;
using cpuserve_vnni::broadcast4;
using cpuserve_vnni::dpbusd;
using cpuserve_vnni::dpbusd_bcast;
using cpuserve_vnni::StoredScales;
using cpuserve_vnni::SuperScales;

// One GEMM's operands; block<R, C>(m, b, ahead) computes rows m..m+R-1 of column blocks b..b+C-1, prefetching the
// codes `ahead` bytes past each step's.
template <int Bits, typename Scales>
struct Gemm {
  using W = Codes<Bits>;
  const int8_t* q;            // [M, K] activation codes
  const float *ax, *axs;      // [M, K / act_group]
  const int32_t* qs;          // [M, K / act_group]: sum of the codes (the symmetric form's zero term)
  const int16_t* qs16;        // the same sums as int16 (block_nested's integer zero term, nested groups only)
  const float* axt;           // [M]: sum of the row's axs (the per-channel form's zero term)
  const uint8_t* w;           // packed
  int64_t w0;                 // the first column block w holds (0, or a tile's unpacked copy: TileView)
  Scales scales;              // StoredScales or SuperScales
  int32_t z;                  // the symmetric form's zero code
  float unscale;              // the symmetric form's 2^-e
  int64_t K, act_group, S, N;
  bf16* out;
  int64_t ldo;                // out's row stride (N, or more when out is a block of columns of a wider output)

  // acc[r][c] += the products of rows qm + r * K and column blocks b + c over inputs k..k+W::kStep-1, prefetching the
  // codes `ahead` bytes past these (inlined: called, the unrolled group of 4-bit codes ran 155 -> 110)
  template <int R, int C>
  __attribute__((always_inline)) void dots(__m512i (&acc)[R][C], const int8_t* qm, int64_t k, int64_t b,
                                           int64_t ahead) const {
    __m512i wk[C][W::kOps];
    for (int c = 0; c < C; ++c) {
      const uint8_t* p = w + (b + c - w0) * K * 2 * Bits + k * 2 * Bits;  // 64 bytes per 4 inputs' worth of operands
      if (ahead > 0)  // every line of the step's codes: 6-bit steps span 3, 8-bit 2 (one left the rest to the hardware)
        for (int o = 0; o < W::kStep * 2 * Bits; o += 64)
          _mm_prefetch(reinterpret_cast<const char*>(p + ahead + o), _MM_HINT_T0);
      W::load(p, wk[c]);
    }
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < W::kOps; ++i) {
        if constexpr (C == 1) {
          acc[r][0] = dpbusd_bcast(acc[r][0], wk[0][i], qm + r * K + k + 4 * i);
        } else {  // one broadcast for the C blocks: Zen 4 runs the memory-broadcast form slower (a loop of
                  // vpdpbusd alone, 6 x 2: 404-459 G multiply-adds a second against 534-540)
          const __m512i a = broadcast4(qm + r * K + k + 4 * i);
          for (int c = 0; c < C; ++c) acc[r][c] = dpbusd(acc[r][c], wk[c][i], a);
        }
      }
  }

  // acc[r][c] = the integer sums of rows m + r and column blocks b + c over group g (`group` inputs), started at the
  // symmetric form's zero term (qs: G groups a row). Steps > 0: the group's steps unrolled.
  template <int R, int C, int Steps>
  __attribute__((always_inline)) void group_dots(__m512i (&acc)[R][C], int64_t m, int64_t g, int64_t group, int64_t G,
                                                 bool symmetric, int64_t b, int64_t ahead) const {
    const int8_t* qm = q + m * K;
    for (int r = 0; r < R; ++r) {
      const __m512i start = symmetric ? _mm512_set1_epi32(-z * qs[(m + r) * G + g]) : _mm512_setzero_si512();
      for (int c = 0; c < C; ++c) acc[r][c] = start;
    }
    // dots called directly, not through a lambda: GCC 12 left such a lambda out of line, with the accumulators
    // stored and reloaded around every step (SmolLM2's 4-bit GEMMs at 512 rows, one thread: 101 G multiply-adds a
    // second that way)
    if constexpr (Steps > 0) {
#pragma GCC unroll 16
      for (int s = 0; s < Steps; ++s) dots<R, C>(acc, qm, g * group + s * W::kStep, b, ahead);
    } else {
      for (int64_t k = g * group; k < (g + 1) * group; k += W::kStep) dots<R, C>(acc, qm, k, b, ahead);
    }
  }

  // block<R, C> where an activation group spans sub = S / (K / act_group) > 1 weight groups (a K-quant's super-block
  // of 256 inputs against its groups of 32 or 16, as llama.cpp's own Q8_K activations): each weight group's integer
  // sum is converted and scaled by the weights' scale into t, the zero term added there, and the activation scale
  // multiplies t once per activation group. Per weight group that is 1 multiply (symmetric) or 2, against 2 or 3
  // with the activation scale per weight group; the sums are as exact and run in the same order for every output
  // element. Steps > 0: a weight group is Steps * W::kStep inputs.
  //
  // Where the activation group is the super-block of a K-quant with sub-mins (Q2_K, Q4_K, Q5_K: int_mins), the zero
  // term is not a multiply per group but zero_term's integer sums, one vpdpwssd per two groups.
  template <int R, int C, int Steps = 0, int Sym = -1>
  void block_nested(int64_t m, int64_t b, int64_t ahead) const {
    const int64_t A = K / act_group, sub = S / A, group = Steps > 0 ? Steps * W::kStep : K / S;
    const bool symmetric = Sym >= 0 ? Sym == 1 : scales.symmetric();
    const bool int_mins = !symmetric && int_mins_zero();
    __m512 y[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) y[r][c] = _mm512_setzero_ps();
    for (int64_t a = 0; a < A; ++a) {
      __m512 t[R][C];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) t[r][c] = _mm512_setzero_ps();
      for (int64_t g = a * sub; g < (a + 1) * sub; ++g) {
        __m512i acc[R][C];
        group_dots<R, C, Steps>(acc, m, g, group, S, symmetric, b, ahead);
        weight_group_terms<R, C>(t, acc, m, g, b, symmetric || int_mins);
      }
      activation_group_terms<R, C>(y, t, m, a, b, int_mins);
    }
    store(m, b, y);
  }

  // block_nested's epilogue of weight group g: t += its integer sums times its scales, plus its zero term unless
  // there is none or zero_term takes it
  template <int R, int C>
  __attribute__((always_inline)) void weight_group_terms(__m512 (&t)[R][C], const __m512i (&acc)[R][C], int64_t m,
                                                         int64_t g, int64_t b, bool no_zoff) const {
    for (int c = 0; c < C; ++c) {
      const __m512 sv = scales.scale(b + c, g);
      for (int r = 0; r < R; ++r) t[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][c]), sv, t[r][c]);
      if (no_zoff) continue;
      const __m512 zv = scales.zoff(b + c, g);
      for (int r = 0; r < R; ++r) t[r][c] = _mm512_fmadd_ps(zv, _mm512_set1_ps(axs[(m + r) * S + g]), t[r][c]);
    }
  }

  // block_nested's epilogue of activation group a (its weight groups' terms in t): y += t times its scale
  template <int R, int C>
  __attribute__((always_inline)) void activation_group_terms(__m512 (&y)[R][C], __m512 (&t)[R][C], int64_t m,
                                                             int64_t a, int64_t b, bool int_mins) const {
    const int64_t A = K / act_group, sub = S / A;
    if (int_mins) zero_term<R, C>(t, m, a * sub, sub, b);
    for (int r = 0; r < R; ++r) {
      const __m512 av = _mm512_set1_ps(ax[(m + r) * A + a]);
      for (int c = 0; c < C; ++c) y[r][c] = _mm512_fmadd_ps(t[r][c], av, y[r][c]);
    }
  }

  // Whether block_nested takes the zero term as zero_term's integer sums: nested groups with sub-mins, an activation
  // group that is the super-block, code sums that fit int16
  bool int_mins_zero() const { return nested() && scales.int_mins(S / (K / act_group)) && K / S <= kInt16Group; }

  // t[r][c] += -dmin * the sum over groups g0..g0+sub-1 of sub_min(c, g) * qs(r, g): exact int32 sums (a sub-min
  // below 64, a group's code sum within +-kInt16Group * 127), then one multiply. Q4_K's 8 groups: 4 vpdpwssd and
  // 1 multiply where the zero term per group took 8 multiplies.
  template <int R, int C>
  __attribute__((always_inline)) void zero_term(__m512 (&t)[R][C], int64_t m, int64_t g0, int64_t sub,
                                                int64_t b) const {
    __m512i zi[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) zi[r][c] = _mm512_setzero_si512();
    for (int64_t g = g0; g < g0 + sub; g += 2)
      for (int c = 0; c < C; ++c) {
        const __m512i mins = scales.min_pair(b + c, g);
        for (int r = 0; r < R; ++r) {
          const __m512i sums = broadcast4(reinterpret_cast<const int8_t*>(qs16 + (m + r) * S + g));  // g's, g + 1's
          zi[r][c] = _mm512_dpwssd_epi32(zi[r][c], mins, sums);
        }
      }
    for (int c = 0; c < C; ++c) {
      const __m512 dm = scales.neg_dmin(b + c, g0);
      for (int r = 0; r < R; ++r) t[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(zi[r][c]), dm, t[r][c]);
    }
  }

  template <int R, int C>
  __attribute__((always_inline)) void store(int64_t m, int64_t b, __m512 (&y)[R][C]) const {
    if (scales.symmetric() && unscale != 1.f)
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) y[r][c] = _mm512_mul_ps(y[r][c], _mm512_set1_ps(unscale));
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (m + r) * ldo + (b + c) * 16),
                            to_bf16_exact(y[r][c]));
  }

  // Steps > 0: act_group is Steps * W::kStep inputs (the group's steps unrolled); Sym >= 0: symmetric() is Sym;
  // Chan >= 0: one scale per output channel (S == 1) is Chan
  template <int R, int C, int Steps = 0, int Sym = -1, int Chan = -1>
  void block(int64_t m, int64_t b, int64_t ahead) const {
    const int64_t A = K / act_group;
    const bool per_channel = Chan >= 0 ? Chan == 1 : S == 1, symmetric = Sym >= 0 ? Sym == 1 : scales.symmetric();
    const int64_t group = Steps > 0 ? Steps * W::kStep : act_group;
    __m512 y[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) y[r][c] = _mm512_setzero_ps();
    for (int64_t g = 0; g < A; ++g) {
      __m512i acc[R][C];
      group_dots<R, C, Steps>(acc, m, g, group, A, symmetric, b, ahead);
      group_terms<R, C>(y, acc, m, g, b, per_channel, symmetric);
    }
    if (per_channel) channel_terms<R, C>(y, m, b, symmetric);
    store(m, b, y);
  }

  // block's epilogue of group g (act_group inputs, the weights' group too unless per channel): y += its integer sums
  // times the activation scale (per channel) or the two scales, plus its zero term unless symmetric
  template <int R, int C>
  __attribute__((always_inline)) void group_terms(__m512 (&y)[R][C], const __m512i (&acc)[R][C], int64_t m, int64_t g,
                                                  int64_t b, bool per_channel, bool symmetric) const {
    const int64_t A = K / act_group;
    if (per_channel) {
      for (int r = 0; r < R; ++r) {
        const __m512 a = _mm512_set1_ps(ax[(m + r) * A + g]);
        for (int c = 0; c < C; ++c) y[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][c]), a, y[r][c]);
      }
      return;
    }
    for (int c = 0; c < C; ++c) {  // the weights' group g (act_group = group)
      const __m512 sv = scales.scale(b + c, g);
      if (symmetric) {
        for (int r = 0; r < R; ++r) {
          const __m512 t = _mm512_mul_ps(sv, _mm512_set1_ps(ax[(m + r) * A + g]));
          y[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][c]), t, y[r][c]);
        }
        continue;
      }
      const __m512 zv = scales.zoff(b + c, g);
      for (int r = 0; r < R; ++r) {
        const __m512 t = _mm512_mul_ps(sv, _mm512_set1_ps(ax[(m + r) * A + g]));
        y[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][c]), t, y[r][c]);
        y[r][c] = _mm512_fmadd_ps(zv, _mm512_set1_ps(axs[(m + r) * A + g]), y[r][c]);
      }
    }
  }

  // block's per-channel tail: y times each channel's scale, plus its zero term unless symmetric
  template <int R, int C>
  __attribute__((always_inline)) void channel_terms(__m512 (&y)[R][C], int64_t m, int64_t b, bool symmetric) const {
    for (int c = 0; c < C; ++c) {
      const __m512 sv = scales.scale(b + c, 0);
      if (symmetric) {
        for (int r = 0; r < R; ++r) y[r][c] = _mm512_mul_ps(y[r][c], sv);
        continue;
      }
      const __m512 zv = scales.zoff(b + c, 0);
      for (int r = 0; r < R; ++r)
        y[r][c] = _mm512_fmadd_ps(y[r][c], sv, _mm512_mul_ps(zv, _mm512_set1_ps(axt[m + r])));
    }
  }

  // block<R, C> for per-channel symmetric codes with one activation group a row (act_group = K: "int8-token"): the
  // integer sums run over all of K with no fp32 accumulator live beside them, then one epilogue, the same instructions
  // per output element as block's per-channel path (whose FMA adds the product to 0). One thread, SmolLM2's four layer
  // GEMMs at 512 rows, alternating builds: 177-202 G multiply-adds a second through block, 200-208 here.
  template <int R, int C>
  void block_token(int64_t m, int64_t b, int64_t ahead) const {
    const int8_t* qm = q + m * K;
    __m512i acc[R][C];
    for (int r = 0; r < R; ++r) {
      const __m512i start = _mm512_set1_epi32(-z * qs[m + r]);
      for (int c = 0; c < C; ++c) acc[r][c] = start;
    }
    for (int64_t k = 0; k < K; k += W::kStep) dots<R, C>(acc, qm, k, b, ahead);
    for (int c = 0; c < C; ++c) {
      const __m512 sv = scales.scale(b + c, 0);
      for (int r = 0; r < R; ++r) {
        __m512 y = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][c]), _mm512_set1_ps(ax[m + r]), _mm512_setzero_ps());
        y = _mm512_mul_ps(y, sv);
        if (unscale != 1.f) y = _mm512_mul_ps(y, _mm512_set1_ps(unscale));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (m + r) * ldo + (b + c) * 16), to_bf16_exact(y));
      }
    }
  }

  template <int R, int C>
  void all_rows_token(int64_t M, int64_t b, int64_t ahead) const {  // as all_rows
    int64_t m = 0;
    const int64_t later = ahead > 0 ? kPrefetch : 0;
    for (; m + R <= M; m += R) block_token<R, C>(m, b, m == 0 ? ahead : later);
    rest<R - 1, C>(m, M - m, b, m == 0 ? ahead : later);  // block's per-channel path: the same bits
  }

  // The AMX path beyond kFewRows rows, for weight groups of 16, 32 or a multiple of 64 inputs: the per-group and
  // per-channel forms, one activation group a row ("int8-token"), and a K-quant's groups inside its super-block. One
  // TDPBSUD makes the integer sums of 16 rows x 16 columns over up to 64 inputs, where a vpdpbusd makes 16 columns of
  // one row over 4. A weight group's sums go through memory into the register blocks' own fp32 epilogue, the same
  // instructions in the same order per output element as block's (block_token's, block_nested's), so a row's bits
  // are those of the register blocks (tests/engine/test_amx_gemm.py).
  int64_t weight_group() const { return nested() ? K / S : act_group; }

  // per-channel symmetric codes with one activation group a row ("int8-token"): the sums stay in the tiles over K
  bool token_form() const { return act_group == K && S == 1 && scales.symmetric(); }

  bool amx_form() const {
    const int64_t wg = weight_group();
    return wg == 16 || wg == 32 || wg % 64 == 0;
  }

  // Inputs per TDPBSUD: a group of 16 or 32, else 64 (a tile row's 64 bytes), the group's sums kept in the tiles
  int64_t amx_step() const { return std::min<int64_t>(weight_group(), 64); }

  cpuserve_amx::TileConfig amx_config() const {
    const int step = static_cast<int>(amx_step());
    cpuserve_amx::TileConfig cfg;
    cfg.set(0, 16, 64), cfg.set(1, 16, 64);              // the sums of two column blocks, int32: even groups
    cfg.set(5, 16, 64), cfg.set(6, 16, 64);              // the same for odd groups
    cfg.set(2, 16, step);                                // 16 rows' activation codes, one step
    cfg.set(3, step / 4, 64), cfg.set(4, step / 4, 64);  // the codes of two column blocks, one step
    return cfg;
  }

  // Weight group w's integer sums of rows m..m+15 into the tiles of w's parity (tmm0-1 or tmm5-6)
  template <typename Tiles, int C, int Odd>
  __attribute__((always_inline)) void amx_group(const uint8_t* codes8, int64_t m, int64_t w) const {
    constexpr int C0 = Odd ? 5 : 0, C1 = Odd ? 6 : 1;
    const int64_t wg = weight_group(), step = amx_step();
    Tiles::template zero<C0>();
    if constexpr (C == 2) Tiles::template zero<C1>();
    for (int64_t k = w * wg; k < (w + 1) * wg; k += step) {
      Tiles::template load<2>(q + m * K + k, K);
      Tiles::template load<3>(codes8 + k * 16, 64);
      Tiles::template dpbsud<C0, 2, 3>();
      if constexpr (C == 2) {
        Tiles::template load<4>(codes8 + (K + k) * 16, 64);
        Tiles::template dpbsud<C1, 2, 4>();
      }
    }
  }

  template <typename Tiles, int C, int Odd>
  __attribute__((always_inline)) static void amx_store(int32_t (*sums)[16][16]) {
    Tiles::template store<Odd ? 5 : 0>(sums[0], 64);
    if constexpr (C == 2) Tiles::template store<Odd ? 6 : 1>(sums[1], 64);
  }

  // Rows m..m+15 of column blocks b..b+C-1 on AMX tiles (Tiles: AmxHw or AmxEmu, configured with amx_config):
  // codes8 holds the blocks' 8-bit codes [C][K/4][64], the layout of a B tile. The groups alternate between two
  // sets of sum tiles, so the TMUL makes group w's sums while the cores store group w - 1's and run its epilogue
  // (stored sums are what a tile path costs: stored and reloaded in the same step, the tiles ran no faster than the
  // register blocks). The epilogue is the register blocks' own, 4 rows at a time, its fp32 sums kept in memory
  // (16 x 2 blocks of them would take every vector register): the same instructions in the same order per output
  // element as block's (block_token's, block_nested's), so a row's bits are the register blocks'.
  template <typename Tiles, int C>
  void amx_rows(const uint8_t* codes8, int64_t m, int64_t b) const {
    constexpr int R = 16, E = 4;  // E: rows per epilogue block
    g_amx_blocks.fetch_add(1, std::memory_order_relaxed);
    const int64_t A = K / act_group, wg = weight_group(), W = K / wg, sub = W / A, G = std::max(A, S);
    const bool nest = nested(), per_channel = S == 1, symmetric = scales.symmetric();
    const bool int_mins = nest && !symmetric && int_mins_zero();
    alignas(64) int32_t sums[C][R][16];
    alignas(64) float ys[R][C][16], ts[R][C][16];  // y (and a nested group's t) of every row, between groups
    std::memset(ys, 0, sizeof(ys));
    const auto epilogue = [&](int64_t w) {
      if (nest && w % sub == 0) std::memset(ts, 0, sizeof(ts));
      for (int r0 = 0; r0 < R; r0 += E) {
        __m512i acc[E][C];  // the group's integer sums, the symmetric form's zero term in them
        __m512 y[E][C], t[E][C];
        for (int r = 0; r < E; ++r)
          for (int c = 0; c < C; ++c) {
            acc[r][c] = _mm512_load_si512(sums[c][r0 + r]);
            if (symmetric) acc[r][c] = _mm512_add_epi32(_mm512_set1_epi32(-z * qs[(m + r0 + r) * G + w]), acc[r][c]);
            y[r][c] = _mm512_load_ps(ys[r0 + r][c]);
          }
        if (!nest) {
          group_terms<E, C>(y, acc, m + r0, w, b, per_channel, symmetric);
        } else {
          for (int r = 0; r < E; ++r)
            for (int c = 0; c < C; ++c) t[r][c] = _mm512_load_ps(ts[r0 + r][c]);
          weight_group_terms<E, C>(t, acc, m + r0, w, b, symmetric || int_mins);
          if (w % sub == sub - 1) activation_group_terms<E, C>(y, t, m + r0, w / sub, b, int_mins);
          for (int r = 0; r < E; ++r)
            for (int c = 0; c < C; ++c) _mm512_store_ps(ts[r0 + r][c], t[r][c]);
        }
        for (int r = 0; r < E; ++r)
          for (int c = 0; c < C; ++c) _mm512_store_ps(ys[r0 + r][c], y[r][c]);
      }
    };
    amx_group<Tiles, C, 0>(codes8, m, 0);
    for (int64_t w = 1; w <= W; ++w) {
      if (w % 2 == 1) {  // group w on the odd tiles while group w - 1's leave the even ones
        if (w < W) amx_group<Tiles, C, 1>(codes8, m, w);
        amx_store<Tiles, C, 0>(sums);
      } else {
        if (w < W) amx_group<Tiles, C, 0>(codes8, m, w);
        amx_store<Tiles, C, 1>(sums);
      }
      epilogue(w - 1);
    }
    for (int r0 = 0; r0 < R; r0 += E) {
      __m512 y[E][C];
      for (int r = 0; r < E; ++r)
        for (int c = 0; c < C; ++c) y[r][c] = _mm512_load_ps(ys[r0 + r][c]);
      if (per_channel && !nest) channel_terms<E, C>(y, m + r0, b, symmetric);
      store<E, C>(m + r0, b, y);
    }
  }

  // This Gemm's rows from m0 on, as a Gemm of M - m0 rows (the operands' row arrays moved on)
  Gemm rows_from(int64_t m0) const {
    Gemm g = *this;
    const int64_t A = K / act_group, G = std::max(A, S);
    g.q += m0 * K, g.ax += m0 * A, g.axs += m0 * G, g.qs += m0 * G, g.qs16 += m0 * G, g.axt += m0;
    g.out += m0 * ldo;
    return g;
  }

  // Every row through column blocks b..b+C-1: R rows per register block, then one block of the last M % R. The
  // first register block prefetches `ahead` bytes past its codes (the rest find them in the caches).
  // Nest: activation groups span several weight groups (block_nested)
  template <int R, int C, int Steps = 0, int Sym = -1, int Chan = -1, int Nest = 0>
  void all_rows(int64_t M, int64_t b, int64_t ahead = kPrefetch) const {
    int64_t m = 0;
    const int64_t later = ahead > 0 ? kPrefetch : 0;  // none: the codes are a tile's unpacked copy
    for (; m + R <= M; m += R) one<R, C, Steps, Sym, Chan, Nest>(m, b, m == 0 ? ahead : later);
    rest<R - 1, C, Steps, Sym, Chan, Nest>(m, M - m, b, m == 0 ? ahead : later);
  }

  template <int R, int C, int Steps = 0, int Sym = -1, int Chan = -1, int Nest = 0>
  void rest(int64_t m, int64_t left, int64_t b, int64_t ahead) const {  // left < R + 1 rows
    if constexpr (R > 0) {
      if (left == R) return one<R, C, Steps, Sym, Chan, Nest>(m, b, ahead);
      rest<R - 1, C, Steps, Sym, Chan, Nest>(m, left, b, ahead);
    }
  }

  template <int R, int C, int Steps, int Sym, int Chan, int Nest>
  void one(int64_t m, int64_t b, int64_t ahead) const {
    if constexpr (Nest == 1) {
      block_nested<R, C, Steps, Sym>(m, b, ahead);
    } else {
      block<R, C, Steps, Sym, Chan>(m, b, ahead);
    }
  }

  bool nested() const { return S > K / act_group; }

  // all_rows with the steps, the form and the nesting read at run time
  template <int R, int C>
  void all_rows_any(int64_t M, int64_t b, int64_t ahead) const {
    if (nested()) return all_rows<R, C, 0, -1, 0, 1>(M, b, ahead);
    all_rows<R, C>(M, b, ahead);
  }

  // all_rows with the group's steps and the symmetric form fixed at compile time where they are the usual ones
  // (groups of 32 or 16): the group's steps unrolled and its epilogue free of branches. The same instructions for each
  // output element in the same order, so a row's result is the runtime path's. One thread, SmolLM2's layer GEMMs:
  // 294-319 against 230-243 G multiply-adds a second at 512 rows, 173-272 against 159-221 at 8 rows.
  template <int R, int C>
  void all_rows_fixed(int64_t M, int64_t b, int64_t ahead) const {
    if (nested()) {  // a K-quant's weight groups of 32 or 16 inside activation groups of a super-block
      const int64_t group = K / S;
      if (group == 32) {
        if (scales.symmetric()) return all_rows<R, C, 32 / W::kStep, 1, 0, 1>(M, b, ahead);
        return all_rows<R, C, 32 / W::kStep, 0, 0, 1>(M, b, ahead);
      }
      if (group == 16) {
        if (scales.symmetric()) return all_rows<R, C, 16 / W::kStep, 1, 0, 1>(M, b, ahead);
        return all_rows<R, C, 16 / W::kStep, 0, 0, 1>(M, b, ahead);
      }
      return all_rows_any<R, C>(M, b, ahead);
    }
    // one activation group a row, beyond decode (whose 8 x 1 blocks ran slower through block_token: one thread,
    // 8 rows, 130 against 143-146 G multiply-adds a second)
    if (C > 1 && S == 1 && act_group == K && scales.symmetric()) return all_rows_token<R, C>(M, b, ahead);
    // Per channel (the engine's own int8 weights, from a float checkpoint) the same way: on the runtime path, one
    // thread, 512 rows made 119-126 G multiply-adds a second, 32 rows 146-160; fixed, 173-182 and 156-176
    if (S == 1 && act_group == 32) {
      if (scales.symmetric()) return all_rows<R, C, 32 / W::kStep, 1, 1>(M, b, ahead);
      return all_rows<R, C, 32 / W::kStep, 0, 1>(M, b, ahead);
    }
    if (S > 1 && act_group == 32) {
      if (scales.symmetric()) return all_rows<R, C, 32 / W::kStep, 1, 0>(M, b, ahead);
      return all_rows<R, C, 32 / W::kStep, 0, 0>(M, b, ahead);
    }
    if (S > 1 && act_group == 16) {  // Q6_K, Q3_K (symmetric), Q2_K
      if (scales.symmetric()) return all_rows<R, C, 16 / W::kStep, 1, 0>(M, b, ahead);
      return all_rows<R, C, 16 / W::kStep, 0, 0>(M, b, ahead);
    }
    all_rows_any<R, C>(M, b, ahead);
  }

  // Beyond kFewRows rows a task is a run of adjacent tiles of kCols column blocks, each computed by a thread's
  // TileView. 6-bit codes are unpacked to 8 bits once per tile there, and a K-quant's factored scales multiplied out
  // into fp32 once, so every register block of rows reads 8-bit codes and stored scales. Unpacking 6-bit codes in the
  // register block took 14 vector instructions per 16 inputs of a column block on the pipes the dot products use,
  // once per row block. (4-bit codes take 3 per 8 inputs and stay packed: unpacked ones made a 4 x 2 block slower,
  // twice the loads for the same dot products.) The same integers and floats either way: a row's result does not
  // depend on the path.
  //
  // While a tile is unpacked (or its first register block streams its codes), the next tile of the run is
  // prefetched, kCols column blocks further on. With a task per tile, each tile started cold, and in prefill the two
  // threads' stores fell on neighbouring 64-byte lines of every output row (a tile's 32 columns of bf16 are one
  // line), which went back and forth between the cores: with runs, 2 threads at 512 rows went from 425-497 to
  // 517-636 G multiply-adds a second, where one thread made 294-319.
  void tile_runs(int64_t M) const {
    const int64_t tiles = (N / 16 + kCols - 1) / kCols;
    const int64_t run = run_length(tiles, kTileRunsPerThread);
    const int amx = amx_form() && M >= (token_form() ? kAmxTokenMinRows : kAmxMinRows) ? amx_mode() : 0;
    cpuserve_tasks::share_tasks((tiles + run - 1) / run, [&](const auto& next) {
      TileView view(*this);  // per thread
      const auto each = [&](const auto& compute) {
        for (int64_t t; (t = next()) >= 0;) {
          const int64_t end = std::min(tiles, (t + 1) * run);
          for (int64_t i = t * run; i < end; ++i) compute(i * kCols, i + 1 < end ? kCols * K * 2 * Bits : 0);
        }
      };
      if (amx == 0) return each([&](int64_t b, int64_t ahead) { view.compute(M, b, ahead); });
      const auto on = [&](auto tiles_kind) {  // the tile configuration is per thread
        using Tiles = decltype(tiles_kind);
        Tiles::config(amx_config());
        each([&](int64_t b, int64_t ahead) { view.template compute_amx<Tiles>(M, b, ahead); });
        Tiles::release();
      };
      if (amx == 1) return on(cpuserve_amx::AmxHw{});
      on(cpuserve_amx::AmxEmu{});
    });
  }

  // A thread's view of one tile at a time: 4- or 8-bit codes and stored scales
  struct TileView {
    static constexpr bool kUnpack = Bits == 6;
    static constexpr int kViewBits = kUnpack ? 8 : Bits;
    using ViewScales = std::conditional_t<Scales::kFactored, StoredScales<float>, Scales>;
    const Gemm& gemm;
    __m512i *codes, *scales;  // kCols column blocks' 8-bit codes [K/4][64]; fp32 scales and zoffs [S][16] each
    Gemm<kViewBits, ViewScales> view;

    explicit TileView(const Gemm& g) : gemm(g) {
      // kept between calls (a thread's first GEMM allocates it): fresh pages would fault on every call
      thread_local std::vector<__m512i> scratch;
      const int64_t n_codes = kUnpack ? kCols * g.K / 4 : 0, n_scales = Scales::kFactored ? 2 * kCols * g.S : 0;
      if (static_cast<int64_t>(scratch.size()) < n_codes + n_scales) scratch.resize(n_codes + n_scales);
      codes = scratch.data(), scales = codes + n_codes;
      const auto* sc = reinterpret_cast<float*>(scales);
      ViewScales vs;
      if constexpr (Scales::kFactored) {
        // after the scales: the zoffs, or the integer sub-mins' pairs and -dmin (S / 2 + S / 2^shift <= S vectors)
        const float* zo = sc + kCols * g.S * 16;
        if (g.int_mins_zero()) {
          const auto* pairs = reinterpret_cast<const int32_t*>(zo);
          vs = StoredScales<float>{sc, nullptr, g.S, 0, pairs, zo + kCols * (g.S / 2) * 16, g.scales.shift};
        } else {
          vs = StoredScales<float>{sc, g.scales.symmetric() ? nullptr : zo, g.S, 0};
        }
      } else {
        vs = g.scales;
      }
      view = Gemm<kViewBits, ViewScales>{g.q,   g.ax, g.axs,       g.qs, g.qs16, g.axt, g.w,   0,
                                         vs,    g.z,  g.unscale,   g.K,  g.act_group,  g.S,  g.N, g.out, g.ldo};
      if constexpr (kUnpack) view.w = reinterpret_cast<const uint8_t*>(codes);
    }

    // The codes of column blocks b..b+n-1 as 8-bit codes [n][K/4][64] at dst, prefetching `ahead` bytes past them
    void unpack(int64_t b, int64_t n, uint8_t* dst, int64_t ahead) const {
      using W = Codes<Bits>;
      const int64_t K = gemm.K;
      for (int64_t c = 0; c < n; ++c) {
        const uint8_t* src = gemm.w + (b + c) * K * 2 * Bits;
        for (int64_t k = 0; k < K; k += W::kStep) {
          const uint8_t* p = src + k * 2 * Bits;
          if (ahead > 0)
            for (int64_t o = 0; o < W::kStep * 2 * Bits; o += 64)
              _mm_prefetch(reinterpret_cast<const char*>(p + ahead + o), _MM_HINT_T0);
          __m512i wk[W::kOps];
          W::load(p, wk);
          for (int i = 0; i < W::kOps; ++i) _mm512_store_si512(dst + (c * K + k) * 16 + 64 * i, wk[i]);
        }
      }
    }

    // compute on AMX tiles (Gemm::amx_form): every 16 rows there, the last M % 16 in register blocks
    template <typename Tiles>
    void compute_amx(int64_t M, int64_t b, int64_t ahead) {
      const int64_t n = std::min<int64_t>(kCols, gemm.N / 16 - b), K = gemm.K;
      const uint8_t* codes8 = gemm.w + b * K * 16;  // 8-bit codes as they are packed
      if constexpr (Bits != 8) {
        thread_local std::vector<__m512i> amx_codes;  // 4-bit codes unpacked (6-bit ones into the view's own copy)
        if (!kUnpack && static_cast<int64_t>(amx_codes.size()) < kCols * K / 4) amx_codes.resize(kCols * K / 4);
        auto* dst = reinterpret_cast<uint8_t*>(kUnpack ? codes : amx_codes.data());
        unpack(b, n, dst, ahead);
        codes8 = dst;
        if constexpr (kUnpack) view.w0 = b;
      }
      expand_scales(b, n);
      int64_t m = 0;
      for (; m + 16 <= M; m += 16) {
        if (n == kCols) view.template amx_rows<Tiles, kCols>(codes8, m, b);
        else view.template amx_rows<Tiles, 1>(codes8, m, b);
      }
      if (m < M) all_rows_of(view.rows_from(m), M - m, b, kUnpack ? 0 : kPrefetch);
    }

    // Every row through the column blocks of tile b (kCols, fewer at the end), prefetching `ahead` bytes past its
    // codes (the next tile's) while unpacking them
    void compute(int64_t M, int64_t b, int64_t ahead) {
      const int64_t n = std::min<int64_t>(kCols, gemm.N / 16 - b);
      if constexpr (kUnpack) {
        unpack(b, n, reinterpret_cast<uint8_t*>(codes), ahead);
        view.w0 = b;
      }
      expand_scales(b, n);
      all_rows_of(view, M, b, kUnpack ? 0 : (ahead > 0 ? ahead : kPrefetch));
    }

    // A K-quant's factored scales of column blocks b..b+n-1 multiplied out into the view's fp32 copy
    void expand_scales(int64_t b, int64_t n) {
      if constexpr (Scales::kFactored) {
        const int64_t S = gemm.S, P = int64_t{1} << gemm.scales.shift;
        auto* sc = reinterpret_cast<float*>(scales);
        float* zo = sc + kCols * S * 16;
        const bool int_mins = view.scales.pairs != nullptr;
        for (int64_t c = 0; c < n; ++c)
          for (int64_t g = 0; g < S; ++g) {
            _mm512_store_ps(sc + (c * S + g) * 16, gemm.scales.scale(b + c, g));
            if (int_mins) {
              auto* pairs = reinterpret_cast<__m512i*>(zo) + c * (S / 2) + g / 2;
              if (g % 2 == 0) _mm512_store_si512(pairs, gemm.scales.min_pair(b + c, g));
              float* dmin = zo + (kCols * (S / 2) + c * (S / P) + g / P) * 16;
              if (g % P == 0) _mm512_store_ps(dmin, gemm.scales.neg_dmin(b + c, g));
            } else if (!gemm.scales.symmetric()) {
              _mm512_store_ps(zo + (c * S + g) * 16, gemm.scales.zoff(b + c, g));
            }
          }
        view.scales.b0 = b;
      }
    }
  };

  void run(int64_t M) const {
    const int64_t num_blocks = N / 16;
    if (M <= kFewRows) {  // decode: a task is a run of column blocks, their weights read once for up to 8 rows
      const int64_t run = run_length(num_blocks, kDecodeTasksPerThread);
      cpuserve_tasks::share_tasks((num_blocks + run - 1) / run, [&](const auto& next) {
        for (int64_t t; (t = next()) >= 0;) {
          const int64_t end = std::min(num_blocks, (t + 1) * run);
          int64_t b = t * run;
          if (Bits == 6 && M <= kPairRows)
            for (; b + 2 <= end; b += 2) all_rows_fixed<kPairRows, 2>(M, b, kPrefetch);
          for (; b < end; ++b) all_rows_fixed<8, 1>(M, b, kPrefetch);
        }
      });
      return;
    }
    tile_runs(M);
  }

  // Every row through the column blocks of task tile b (kCols blocks, fewer at the end)
  template <typename G>
  static void all_rows_of(const G& gemm, int64_t M, int64_t b, int64_t ahead) {
    const int64_t num_blocks = gemm.N / 16;
    if (b + kCols <= num_blocks) {
      // nested groups keep a third set of accumulators (block_nested): 4 x 2 blocks, which fit in registers
      if (M <= kSmallRows || gemm.nested()) return gemm.template all_rows_fixed<kSmallRowsBlock, kCols>(M, b, ahead);
      return gemm.template all_rows_fixed<kRows, kCols>(M, b, ahead);
    }
    for (int64_t bb = b; bb < num_blocks; ++bb) gemm.template all_rows_any<kRows, 1>(M, bb, ahead);
  }
};

#endif

#if defined(CPUSERVE_AVX2_GEMM)  // the same entry below, over avx2_gemm.h's register blocks
using cpuserve_avx2::Gemm;
using cpuserve_avx2::StoredScales;
using cpuserve_avx2::SuperScales;
#endif

#if defined(CPUSERVE_INT8_GEMM)
// x [M, K] bf16 -> q [M, K] int8, ax per act_group, axs and qs per sum_group (act_quant.h group_sums), axt per row;
// rows shared between threads when there are many
void quantize_rows(const bf16* x, int64_t M, int64_t K, int64_t act_group, int64_t sum_group, int8_t* q, float* ax,
                   float* axs, int32_t* qs, int16_t* qs16, float* axt) {
  const int64_t A = K / act_group, G = K / sum_group;
  const auto rows = [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      cpuserve_act::quantize_row(x + m * K, K, act_group, q + m * K, ax + m * A);
      cpuserve_act::group_sums(q + m * K, ax + m * A, K, act_group, sum_group, axs + m * G, qs + m * G, qs16 + m * G);
      axt[m] = 0.f;
      for (int64_t g = 0; g < G; ++g) axt[m] += axs[m * G + g];
    }
  };
  if (M < 2 * kQuantRowsPerTask) return rows(0, M);
  cpuserve_tasks::share_tasks((M + kQuantRowsPerTask - 1) / kQuantRowsPerTask, [&](const auto& next) {
    for (int64_t t; (t = next()) >= 0;) rows(t * kQuantRowsPerTask, std::min(M, (t + 1) * kQuantRowsPerTask));
  });
}
#endif

// The scales' form: stored (fp32 or fp16 scales [N/16, S, 16], zoffs alike) or, with supers, a K-quant's factors
// (SuperScales); zoffs {z, e} for symmetric codes either way (e = 0 with supers)
void check_scales(const at::Tensor& scales, const at::Tensor& zoffs, const c10::optional<at::Tensor>& supers,
                  int64_t bits, int64_t N, int64_t K, int64_t act_group) {
  TORCH_CHECK(!supers.has_value() || bits == 4 || bits == 6, "factored scales (supers) go with 4- or 6-bit codes, got ",
              bits);
  const int64_t S = scales.size(1);
  TORCH_CHECK(S == 1 || (S % (K / act_group) == 0 && K % S == 0 && (K / S) % 16 == 0),
              "scales must have 1 (per channel) or K/act_group=", K / act_group,
              " groups or a multiple of it (weight groups of 16 or more inputs inside each activation group), got ", S);
  const bool symmetric = zoffs.scalar_type() == at::kInt;
  const int32_t* header = symmetric && zoffs.numel() == 2 && zoffs.is_contiguous() ? zoffs.data_ptr<int32_t>() : nullptr;
  TORCH_CHECK(!symmetric || (header && header[0] >= 0 && header[0] < (1 << bits) && header[1] >= 0 && header[1] < 64),
              "zoffs must be like scales, or two int32 {z, e}: a zero code z below 2**bits and 0 <= e < 64; got ",
              zoffs.scalar_type(), " ", zoffs.sizes());
  const bool shape = scales.is_contiguous() && scales.sizes() == at::IntArrayRef({N / 16, S, 16});
  const bool like_scales = zoffs.is_contiguous() && zoffs.sizes() == scales.sizes();
  if (!supers.has_value()) {
    TORCH_CHECK((scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf) && shape,
                "scales must be contiguous fp32 or fp16 [N/16, S, 16], got ", scales.scalar_type(), " ", scales.sizes());
    TORCH_CHECK(symmetric || (zoffs.scalar_type() == scales.scalar_type() && like_scales),
                "zoffs must be like scales, or two int32 {z, e}; got ", zoffs.scalar_type(), " ", zoffs.sizes());
    return;
  }
  const at::Tensor& sp = *supers;
  TORCH_CHECK((scales.scalar_type() == at::kByte || scales.scalar_type() == at::kChar) && shape && S > 1,
              "with supers, scales must be contiguous uint8 or int8 sub-scales [N/16, K/act_group, 16], got ",
              scales.scalar_type(), " ", scales.sizes());
  const bool twelve_bits = scales.scalar_type() == at::kByte && zoffs.scalar_type() == at::kByte &&
                           zoffs.is_contiguous() && S % 2 == 0 && zoffs.sizes() == at::IntArrayRef({N / 16, S / 2, 16});
  TORCH_CHECK(symmetric ? header[1] == 0 : twelve_bits,
              "with supers, zoffs must be {z, 0} or the sub-mins' high nibbles, uint8 [N/16, S/2, 16] (two groups a "
              "byte, beside uint8 scales); got ", zoffs.scalar_type(), " ", zoffs.sizes());
  const int64_t P = sp.dim() == 4 && sp.size(1) > 0 && S % sp.size(1) == 0 ? S / sp.size(1) : 0;
  TORCH_CHECK(sp.scalar_type() == at::kHalf && sp.is_contiguous() && P > 0 && (P & (P - 1)) == 0 &&
                  sp.sizes() == at::IntArrayRef({N / 16, S / P, symmetric ? 1 : 2, 16}),
              "supers must be contiguous fp16 [N/16, S/P, F, 16], P a power of two, F = 1 (symmetric) or 2, got ",
              sp.scalar_type(), " ", sp.sizes());
}

// x [M, K] bf16; packed [N/16, K*bits/32, 64] uint8; scales, zoffs, supers: check_scales; out [M, N] bf16, rows
// of any stride (a StackedLinear's part writes its columns). The operands of every GEMM over these layouts
// (vnni_gemm, amx_bf16_gemm.cpp).
void check_operands(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& zoffs,
                    int64_t bits, int64_t act_group, const c10::optional<at::Tensor>& supers, const at::Tensor& out) {
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, "bits must be 4, 6 or 8, got ", bits);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.size(2) == 64 && packed.is_contiguous() &&
                  packed.size(1) * 32 % bits == 0,
              "packed must be contiguous uint8 [N/16, K*bits/32, 64], got ", packed.scalar_type(), " ", packed.sizes());
  const int64_t N = packed.size(0) * 16, K = packed.size(1) * 32 / bits;
  TORCH_CHECK(act_group % 16 == 0 && K % act_group == 0 && act_group <= 65536, "act_group=", act_group,
              " must be a multiple of 16 dividing K=", K, ", at most 65536 (a group's integer sum must fit int32)");
  check_scales(scales, zoffs, supers, bits, N, K, act_group);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous() && x.size(1) == K,
              "x must be contiguous bf16 [M, ", K, "], got ", x.scalar_type(), " ", x.sizes());
  const int64_t M = x.size(0);
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.sizes() == at::IntArrayRef({M, N}) && out.stride(1) == 1 &&
                  out.stride(0) >= N,
              "out must be bf16 [", M, ", ", N, "] with contiguous rows (a block of columns of a wider output, too), "
              "got ", out.scalar_type(), " ", out.sizes(), " strides ", out.strides());
}

at::Tensor& vnni_gemm_out(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                          const at::Tensor& zoffs, int64_t bits, int64_t act_group,
                          const c10::optional<at::Tensor>& supers, at::Tensor& out) {
  TORCH_CHECK(vnni_gemm_supported(), "the int8 dot-product GEMMs need AVX-512 VNNI or AVX2 (this build has neither)");
  check_operands(x, packed, scales, zoffs, bits, act_group, supers, out);
  g_runs.fetch_add(1, std::memory_order_relaxed);
  const int64_t N = packed.size(0) * 16, K = packed.size(1) * 32 / bits, S = scales.size(1), M = x.size(0);
#if defined(CPUSERVE_INT8_GEMM)
  auto q = at::empty({M, K}, x.options().dtype(at::kChar));
  const int64_t A = K / act_group, G = std::max(A, S);  // G: the zero terms' groups (the weights' when nested)
  // ax [M, A]; axs, qs [M, G]; axt [M]; qs16 [M, G] int16
  auto terms = at::empty({M * (A + 2 * G + 1) + (M * G + 1) / 2}, x.options().dtype(at::kFloat));
  float *ax = terms.data_ptr<float>(), *axs = ax + M * A, *axt = axs + 2 * M * G;
  int32_t* qs = reinterpret_cast<int32_t*>(axs + M * G);
  int16_t* qs16 = reinterpret_cast<int16_t*>(axt + M);
  quantize_rows(x.data_ptr<bf16>(), M, K, act_group, K / G, q.data_ptr<int8_t>(), ax, axs, qs, qs16, axt);
  const bool symmetric = zoffs.scalar_type() == at::kInt;
  const int32_t* header = symmetric ? zoffs.data_ptr<int32_t>() : nullptr;
  const auto widths = [&](auto form) {
    using Scales = decltype(form);
    const auto go = [&](auto gemm) {
      gemm.q = q.data_ptr<int8_t>(), gemm.ax = ax, gemm.axs = axs, gemm.qs = qs, gemm.qs16 = qs16, gemm.axt = axt;
      gemm.w = packed.data_ptr<uint8_t>(), gemm.scales = form;
      gemm.z = symmetric ? header[0] : 0, gemm.unscale = symmetric ? std::ldexp(1.f, -header[1]) : 1.f;
      gemm.K = K, gemm.act_group = act_group, gemm.S = S, gemm.N = N, gemm.out = out.data_ptr<bf16>();
      gemm.ldo = out.stride(0);
      gemm.run(M);
    };
    if (bits == 4) return go(Gemm<4, Scales>{});
    if (bits == 6) return go(Gemm<6, Scales>{});
    if constexpr (!Scales::kFactored) go(Gemm<8, Scales>{});
  };
  if (supers.has_value()) {
    const auto* sup = supers->data_ptr<at::Half>();
    const uint8_t* mins = symmetric ? nullptr : zoffs.data_ptr<uint8_t>();
    const int64_t shift = __builtin_ctzll(S / supers->size(1)), F = supers->size(2);
    if (scales.scalar_type() == at::kByte) {
      widths(SuperScales<uint8_t>{scales.data_ptr<uint8_t>(), mins, sup, S, shift, F});
    } else {
      widths(SuperScales<int8_t>{scales.data_ptr<int8_t>(), mins, sup, S, shift, F});
    }
  } else if (scales.scalar_type() == at::kHalf) {
    widths(StoredScales<at::Half>{scales.data_ptr<at::Half>(), symmetric ? nullptr : zoffs.data_ptr<at::Half>(), S, 0});
  } else {
    widths(StoredScales<float>{scales.data_ptr<float>(), symmetric ? nullptr : zoffs.data_ptr<float>(), S, 0});
  }
#endif
  return out;
}

at::Tensor vnni_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& zoffs,
                     int64_t bits, int64_t act_group, const c10::optional<at::Tensor>& supers) {
  auto out = at::empty({x.size(0), packed.size(0) * 16}, x.options());
  return vnni_gemm_out(x, packed, scales, zoffs, bits, act_group, supers, out);
}

// The AMX path's mode: mode "off", "auto" (the instructions where the CPU and Linux give them) or "emulate" (their
// software model: tests), or "" to keep it; returns the mode in force: "off", "hw" or "emulate"
std::string vnni_gemm_amx(const std::string& mode) {
  TORCH_CHECK(mode.empty() || mode == "off" || mode == "auto" || mode == "emulate",
              "vnni_gemm_amx: mode must be off, auto or emulate, got ", mode);
  if (mode == "off") g_amx = 0;
  if (mode == "emulate") g_amx = 2;
  if (mode == "auto") g_amx = cpuserve_amx::amx_hw_available() ? 1 : 0;
  static const char* const kNames[] = {"off", "hw", "emulate"};
  return kNames[amx_mode()];
}

int64_t vnni_gemm_amx_blocks() { return g_amx_blocks.load(); }

int64_t vnni_gemm_runs() { return g_runs.load(); }

// The instructions this build's int8 GEMMs run on: "avx512_vnni" (and AMX tiles, vnni_gemm_amx), "avx_vnni" or
// "avx2" (avx2_gemm.h), or "" where they are not built
std::string vnni_gemm_isa() {
#if defined(CPUSERVE_VNNI)
  return "avx512_vnni";
#elif defined(CPUSERVE_AVX2_GEMM) && defined(__AVXVNNI__)
  return "avx_vnni";
#elif defined(CPUSERVE_AVX2_GEMM)
  return "avx2";
#else
  return "";
#endif
}

}  // namespace

void cpuserve_ops::check_gemm_operands(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                                       const at::Tensor& zoffs, int64_t bits, int64_t act_group,
                                       const c10::optional<at::Tensor>& supers, const at::Tensor& out) {
  check_operands(x, packed, scales, zoffs, bits, act_group, supers, out);
}

at::Tensor& cpuserve_ops::vnni_gemm_out(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                                        const at::Tensor& zoffs, int64_t bits, int64_t act_group,
                                        const c10::optional<at::Tensor>& supers, at::Tensor& out) {
  return ::vnni_gemm_out(x, packed, scales, zoffs, bits, act_group, supers, out);
}

TORCH_LIBRARY_FRAGMENT(cpuserve, m) {
  m.def("vnni_gemm(Tensor x, Tensor packed, Tensor scales, Tensor zoffs, int bits, int act_group, "
        "Tensor? supers=None) -> Tensor");
  m.def("vnni_gemm.out(Tensor x, Tensor packed, Tensor scales, Tensor zoffs, int bits, int act_group, "
        "Tensor? supers=None, *, Tensor(a!) out) -> Tensor(a!)");
  m.def("vnni_gemm_supported() -> bool");
  m.def("vnni_gemm_amx(str mode=\"\") -> str");
  m.def("vnni_gemm_amx_blocks() -> int");
  m.def("vnni_gemm_runs() -> int");
  m.def("vnni_gemm_isa() -> str");
}

TORCH_LIBRARY_IMPL(cpuserve, CPU, m) {
  m.impl("vnni_gemm", &vnni_gemm);
  m.impl("vnni_gemm.out", &vnni_gemm_out);
}

TORCH_LIBRARY_IMPL(cpuserve, CompositeExplicitAutograd, m) {
  m.impl("vnni_gemm_supported", &vnni_gemm_supported);
  m.impl("vnni_gemm_amx", &vnni_gemm_amx);
  m.impl("vnni_gemm_amx_blocks", &vnni_gemm_amx_blocks);
  m.impl("vnni_gemm_runs", &vnni_gemm_runs);
  m.impl("vnni_gemm_isa", &vnni_gemm_isa);
}
