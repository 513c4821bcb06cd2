// The int8 dot-product GEMMs beyond decode's few rows on AVX-512: the output's columns in tiles of kCols column blocks
// (16 columns each), a task a run of adjacent tiles, every row through each tile, in register blocks
// (vnni_register_blocks.h) or, from enough rows, on AMX tiles (vnni_amx_rows.h).
//
// A thread's ColumnTile holds one tile at a time as the register blocks read it best. 6-bit codes are unpacked to
// 8 bits once per tile there, and a K-quant's factored scales multiplied out into fp32 once, so every register block
// of rows reads 8-bit codes and stored scales. Unpacking 6-bit codes in the register block took 14 vector
// instructions per 16 inputs of a column block on the pipes the dot products use, once per row block. (4-bit codes
// take 3 per 8 inputs and stay packed: unpacked ones made a 4 x 2 block slower, twice the loads for the same dot
// products.) The same integers and floats either way: a row's result does not depend on the path.
//
// While a tile is unpacked (or its first register block streams its codes), the next tile of the run is
// prefetched, kCols column blocks further on. With a task per tile, each tile started cold, and in prefill the two
// threads' stores fell on neighbouring 64-byte lines of every output row (a tile's 32 columns of bf16 are one
// line), which went back and forth between the cores: with runs, 2 threads at 512 rows went from 425-497 to
// 517-636 G multiply-adds a second, where one thread made 294-319.
#pragma once

#include "amx_tiles.h"
#include "int8_gemm_operands.h"
#include "tasks.h"
#include "vnni_amx_rows.h"
#include "vnni_layouts.h"
#include "vnni_register_blocks.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(CPUSERVE_VNNI)
namespace cpuserve_vnni {

using cpuserve_int8::GemmOperands;

// Register blocks of kRows rows x kCols column blocks, 12 int32 + 12 fp32 accumulators. One thread, SmolLM2's layer
// GEMMs at 512 rows, hot: 6 x 2 made 294-319 G multiply-adds a second, 5 x 2 293-314, 4 x 2 280-298, 4 x 3 271-297,
// 8 x 2 (spilling) 242-254.
constexpr int kCols = 2;
constexpr int kRows = 6;
// Up to kSmallRows rows (batched decode) the blocks are 4 rows x 2 column blocks: 32 rows as 6 x 5 + 2 made 279-353
// (qkv, o) and 396-465 (down, gate_up) G multiply-adds a second on 2 threads, as 4 x 8 378-460 and 452-547.
constexpr int64_t kSmallRows = 32;
constexpr int kSmallRowsBlock = 4;
// Tile runs per thread (as vnni_gemm.cpp's decode tasks per thread)
constexpr int64_t kTileRunsPerThread = 4;
// The int8 GEMMs take AMX tiles (amx_rows) from this many rows: below it their per-group epilogue, the same as the
// register blocks', outweighs what the tiles save. One thread of a 2-core Xeon with AMX, SmolLM2's four layer
// GEMMs (Q4_1 codes), tiles against registers: 0.82-1.0x at 32 and 64 rows, 0.96-1.19x at 128, 1.03-1.15x at 256,
// 1.07-1.19x at 512. (Prompt rows take amx_bf16_gemm.cpp where the CPU has AMX-BF16: 2.8-3.5x at 512 rows.)
constexpr int64_t kAmxMinRows = 128;
// The per-token form (is_token_form, vLLM's W8A8 scheme) has no per-group epilogue: its sums stay in the tiles over
// all of K, so the tiles take it from 32 rows (batched decode at 32 streams). 2 threads of the same Xeon, a 3B
// model's four layer GEMMs (K = 3072 and 8192), tiles against registers: 2.3x at 32 rows, 2.1x at 64, 2.7x at 96,
// 2.8x at 512.
constexpr int64_t kAmxTokenMinRows = 32;

// Every row through the column blocks of tile b (kCols blocks, fewer at the end), in register blocks
template <int Bits, typename Scales>
inline void tile_rows(const GemmOperands<Scales>& gemm, int64_t M, int64_t b, int64_t ahead) {
  const int64_t num_blocks = gemm.N / 16;
  if (b + kCols <= num_blocks) {
    // nested groups keep a third set of accumulators (block_nested): 4 x 2 blocks, which fit in registers
    if (M <= kSmallRows || gemm.is_nested()) return all_rows_fixed<Bits, kSmallRowsBlock, kCols>(gemm, M, b, ahead);
    return all_rows_fixed<Bits, kRows, kCols>(gemm, M, b, ahead);
  }
  for (int64_t bb = b; bb < num_blocks; ++bb) all_rows_at_run_time<Bits, kRows, 1>(gemm, M, bb, ahead);
}

// A thread's view of one tile at a time: 4- or 8-bit codes and stored scales
template <int Bits, typename Scales>
struct ColumnTile {
  static constexpr bool kUnpack = Bits == 6;
  static constexpr int kViewBits = kUnpack ? 8 : Bits;
  using ViewScales = std::conditional_t<Scales::kFactored, StoredScales<float>, Scales>;
  const GemmOperands<Scales>& gemm;
  // kCols column blocks' 8-bit codes [K/4][64]; fp32 scales and zoffs [num_weight_groups][16] each
  __m512i *unpacked_codes, *expanded_scales;
  GemmOperands<ViewScales> view;

  explicit ColumnTile(const GemmOperands<Scales>& g) : gemm(g) {
    const int64_t num_groups = g.num_weight_groups;
    // kept between calls (a thread's first GEMM allocates it): fresh pages would fault on every call
    thread_local std::vector<__m512i> scratch;
    const int64_t n_codes = kUnpack ? kCols * g.K / 4 : 0, n_scales = Scales::kFactored ? 2 * kCols * num_groups : 0;
    if (static_cast<int64_t>(scratch.size()) < n_codes + n_scales) scratch.resize(n_codes + n_scales);
    unpacked_codes = scratch.data(), expanded_scales = unpacked_codes + n_codes;
    const auto* scales = reinterpret_cast<float*>(expanded_scales);
    ViewScales view_scales;
    if constexpr (Scales::kFactored) {
      // after the scales: the zoffs, or the integer sub-mins' pairs and -dmin (S / 2 + S / 2^shift <= S vectors)
      const float* zoffs = scales + kCols * num_groups * 16;
      if (g.has_int_zero_term()) {
        const auto* pairs = reinterpret_cast<const int32_t*>(zoffs);
        view_scales = StoredScales<float>{scales, nullptr, num_groups, 0, pairs, zoffs + kCols * (num_groups / 2) * 16,
                                          g.scales.shift};
      } else {
        view_scales = StoredScales<float>{scales, g.scales.symmetric() ? nullptr : zoffs, num_groups, 0};
      }
    } else {
      view_scales = g.scales;
    }
    view = GemmOperands<ViewScales>{g.act_codes, g.act_scales, g.act_sums, g.code_sums, g.code_sums16,
                                    g.act_row_sum, g.packed, 0, view_scales, g.zero_code, g.unscale, g.K,
                                    g.act_group, num_groups, g.N, g.out, g.out_stride};
    if constexpr (kUnpack) view.packed = reinterpret_cast<const uint8_t*>(unpacked_codes);
  }

  // The codes of column blocks b..b+n-1 as 8-bit codes [n][K/4][64] at dst, prefetching `ahead` bytes past them
  void unpack(int64_t b, int64_t n, uint8_t* dst, int64_t ahead) const {
    using W = Codes<Bits>;
    const int64_t K = gemm.K;
    for (int64_t c = 0; c < n; ++c) {
      const uint8_t* src = gemm.packed + (b + c) * K * 2 * Bits;
      for (int64_t k = 0; k < K; k += W::kStep) {
        const uint8_t* p = src + k * 2 * Bits;
        if (ahead > 0)
          for (int64_t o = 0; o < W::kStep * 2 * Bits; o += 64)
            _mm_prefetch(reinterpret_cast<const char*>(p + ahead + o), _MM_HINT_T0);
        __m512i codes[W::kOps];
        W::load(p, codes);
        for (int i = 0; i < W::kOps; ++i) _mm512_store_si512(dst + (c * K + k) * 16 + 64 * i, codes[i]);
      }
    }
  }

  // compute on AMX tiles (is_amx_form): every 16 rows there, the last M % 16 in register blocks
  template <typename Tiles>
  void compute_amx(int64_t M, int64_t b, int64_t ahead) {
    const int64_t n = std::min<int64_t>(kCols, gemm.N / 16 - b), K = gemm.K;
    const uint8_t* codes8 = gemm.packed + b * K * 16;  // 8-bit codes as they are packed
    if constexpr (Bits != 8) {
      thread_local std::vector<__m512i> amx_codes;  // 4-bit codes unpacked (6-bit ones into unpacked_codes)
      if (!kUnpack && static_cast<int64_t>(amx_codes.size()) < kCols * K / 4) amx_codes.resize(kCols * K / 4);
      auto* dst = reinterpret_cast<uint8_t*>(kUnpack ? unpacked_codes : amx_codes.data());
      unpack(b, n, dst, ahead);
      codes8 = dst;
      if constexpr (kUnpack) view.first_block = b;
    }
    expand_scales(b, n);
    int64_t m = 0;
    for (; m + 16 <= M; m += 16) {
      if (n == kCols) amx_rows<Tiles, kCols>(view, codes8, m, b);
      else amx_rows<Tiles, 1>(view, codes8, m, b);
    }
    if (m < M) tile_rows<kViewBits>(view.rows_from(m), M - m, b, kUnpack ? 0 : kPrefetch);
  }

  // Every row through the column blocks of tile b (kCols, fewer at the end), prefetching `ahead` bytes past its
  // codes (the next tile's) while unpacking them
  void compute(int64_t M, int64_t b, int64_t ahead) {
    const int64_t n = std::min<int64_t>(kCols, gemm.N / 16 - b);
    if constexpr (kUnpack) {
      unpack(b, n, reinterpret_cast<uint8_t*>(unpacked_codes), ahead);
      view.first_block = b;
    }
    expand_scales(b, n);
    tile_rows<kViewBits>(view, M, b, kUnpack ? 0 : (ahead > 0 ? ahead : kPrefetch));
  }

  // A K-quant's factored scales of column blocks b..b+n-1 multiplied out into the view's fp32 copy
  void expand_scales(int64_t b, int64_t n) {
    if constexpr (Scales::kFactored) {
      const int64_t num_groups = gemm.num_weight_groups, per_super = int64_t{1} << gemm.scales.shift;
      auto* scales = reinterpret_cast<float*>(expanded_scales);
      float* zoffs = scales + kCols * num_groups * 16;
      const bool int_mins = view.scales.pairs != nullptr;
      for (int64_t c = 0; c < n; ++c)
        for (int64_t g = 0; g < num_groups; ++g) {
          _mm512_store_ps(scales + (c * num_groups + g) * 16, gemm.scales.scale(b + c, g));
          if (int_mins) {
            auto* pairs = reinterpret_cast<__m512i*>(zoffs) + c * (num_groups / 2) + g / 2;
            if (g % 2 == 0) _mm512_store_si512(pairs, gemm.scales.min_pair(b + c, g));
            float* neg_dmin = zoffs + (kCols * (num_groups / 2) + c * (num_groups / per_super) + g / per_super) * 16;
            if (g % per_super == 0) _mm512_store_ps(neg_dmin, gemm.scales.neg_dmin(b + c, g));
          } else if (!gemm.scales.symmetric()) {
            _mm512_store_ps(zoffs + (c * num_groups + g) * 16, gemm.scales.zoff(b + c, g));
          }
        }
      view.scales.b0 = b;
    }
  }
};

// Every row of the GEMM in runs of adjacent column tiles, a task a run; on AMX tiles where the form and the rows
// take them (amx_mode)
template <int Bits, typename Scales>
inline void tile_runs(const GemmOperands<Scales>& gemm, int64_t M) {
  const int64_t tiles = (gemm.N / 16 + kCols - 1) / kCols;
  const int64_t run = cpuserve_tasks::run_length(tiles, kTileRunsPerThread);
  const int64_t amx_min_rows = is_token_form(gemm) ? kAmxTokenMinRows : kAmxMinRows;
  const int amx = is_amx_form(gemm) && M >= amx_min_rows ? amx_mode() : 0;
  cpuserve_tasks::share_tasks((tiles + run - 1) / run, [&](const auto& next) {
    ColumnTile<Bits, Scales> tile(gemm);  // per thread
    const auto each_tile = [&](const auto& compute) {
      for (int64_t t; (t = next()) >= 0;) {
        const int64_t end = std::min(tiles, (t + 1) * run);
        for (int64_t i = t * run; i < end; ++i) compute(i * kCols, i + 1 < end ? kCols * gemm.K * 2 * Bits : 0);
      }
    };
    if (amx == 0) return each_tile([&](int64_t b, int64_t ahead) { tile.compute(M, b, ahead); });
    const auto on_amx = [&](auto tiles_kind) {  // the tile configuration is per thread
      using Tiles = decltype(tiles_kind);
      Tiles::config(amx_config(gemm));
      each_tile([&](int64_t b, int64_t ahead) { tile.template compute_amx<Tiles>(M, b, ahead); });
      Tiles::release();
    };
    if (amx == 1) return on_amx(cpuserve_amx::AmxHw{});
    on_amx(cpuserve_amx::AmxEmu{});
  });
}

}  // namespace cpuserve_vnni
#endif
