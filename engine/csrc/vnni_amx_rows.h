// The int8 dot-product GEMMs' AMX path: 16 rows x 1 or 2 column blocks at a time on the tiles (amx_tiles.h), for
// weight groups of 16, 32 or a multiple of 64 inputs: the per-group and per-channel forms, one activation group a
// row ("int8-token"), and a K-quant's groups inside its super-block. One TDPBSUD makes the integer sums of 16 rows
// x 16 columns over up to 64 inputs, where a vpdpbusd makes 16 columns of one row over 4. A weight group's sums go
// through memory into the register blocks' own fp32 epilogue (vnni_epilogue.h), the same instructions in the same
// order per output element as block's (block_token's, block_nested's), so a row's bits are those of the register
// blocks (tests/engine/test_amx_gemm.py).
#pragma once

#include "amx_tiles.h"
#include "int8_gemm_operands.h"
#include "vnni_epilogue.h"
#include "vnni_layouts.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#if defined(CPUSERVE_VNNI)
namespace cpuserve_vnni {

using cpuserve_int8::GemmOperands;

// The AMX path's mode: 0 off, 1 the instructions (AmxHw), 2 their software model (AmxEmu, for tests); -1 until
// first asked (amx_mode). Hidden, as a .cpp's own statics are: read and counted without a load from the GOT.
__attribute__((visibility("hidden"))) inline std::atomic<int> g_amx_mode{-1};
__attribute__((visibility("hidden"))) inline std::atomic<int64_t> g_amx_blocks{0};  // 16-row blocks on tiles (tests)

// The mode in force; on first use the instructions where the CPU and Linux give them, unless CPUSERVE_AMX=off
inline int amx_mode() {
  int mode = g_amx_mode.load();
  if (mode < 0) {
    const char* env = std::getenv("CPUSERVE_AMX");
    const bool off = env != nullptr && std::string(env) == "off";
    int want = !off && cpuserve_amx::amx_hw_available() ? 1 : 0;
    g_amx_mode.compare_exchange_strong(mode, want);
    mode = g_amx_mode.load();
  }
  return mode;
}

// Per-channel symmetric codes with one activation group a row ("int8-token"): the sums stay in the tiles over K
template <typename Scales>
inline bool is_token_form(const GemmOperands<Scales>& gemm) {
  return gemm.act_group == gemm.K && gemm.num_weight_groups == 1 && gemm.scales.symmetric();
}

template <typename Scales>
inline bool is_amx_form(const GemmOperands<Scales>& gemm) {
  const int64_t group = gemm.weight_group_size();
  return group == 16 || group == 32 || group % 64 == 0;
}

// Inputs per TDPBSUD: a group of 16 or 32, else 64 (a tile row's 64 bytes), the group's sums kept in the tiles
template <typename Scales>
inline int64_t amx_step(const GemmOperands<Scales>& gemm) {
  return std::min<int64_t>(gemm.weight_group_size(), 64);
}

template <typename Scales>
inline cpuserve_amx::TileConfig amx_config(const GemmOperands<Scales>& gemm) {
  const int step = static_cast<int>(amx_step(gemm));
  cpuserve_amx::TileConfig cfg;
  cfg.set(0, 16, 64), cfg.set(1, 16, 64);              // the sums of two column blocks, int32: even groups
  cfg.set(5, 16, 64), cfg.set(6, 16, 64);              // the same for odd groups
  cfg.set(2, 16, step);                                // 16 rows' activation codes, one step
  cfg.set(3, step / 4, 64), cfg.set(4, step / 4, 64);  // the codes of two column blocks, one step
  return cfg;
}

// Weight group g's integer sums of rows m..m+15 into the tiles of g's parity (tmm0-1 or tmm5-6)
template <typename Tiles, int C, int Odd, typename Scales>
CPUSERVE_HOT void tile_group_sums(const GemmOperands<Scales>& gemm, const uint8_t* codes8, int64_t m, int64_t g) {
  constexpr int C0 = Odd ? 5 : 0, C1 = Odd ? 6 : 1;
  const int64_t K = gemm.K, group = gemm.weight_group_size(), step = amx_step(gemm);
  Tiles::template zero<C0>();
  if constexpr (C == 2) Tiles::template zero<C1>();
  for (int64_t k = g * group; k < (g + 1) * group; k += step) {
    Tiles::template load<2>(gemm.act_codes + m * K + k, K);
    Tiles::template load<3>(codes8 + k * 16, 64);
    Tiles::template dpbsud<C0, 2, 3>();
    if constexpr (C == 2) {
      Tiles::template load<4>(codes8 + (K + k) * 16, 64);
      Tiles::template dpbsud<C1, 2, 4>();
    }
  }
}

template <typename Tiles, int C, int Odd>
CPUSERVE_HOT void store_tile_sums(int32_t (*sums)[16][16]) {
  Tiles::template store<Odd ? 5 : 0>(sums[0], 64);
  if constexpr (C == 2) Tiles::template store<Odd ? 6 : 1>(sums[1], 64);
}

// Rows m..m+15 of column blocks b..b+C-1 on AMX tiles (Tiles: AmxHw or AmxEmu, configured with amx_config):
// codes8 holds the blocks' 8-bit codes [C][K/4][64], the layout of a B tile. The groups alternate between two
// sets of sum tiles, so the TMUL makes group g's sums while the cores store group g - 1's and run its epilogue
// (stored sums are what a tile path costs: stored and reloaded in the same step, the tiles ran no faster than the
// register blocks). The epilogue is the register blocks' own, 4 rows at a time, its fp32 sums kept in memory
// (16 x 2 blocks of them would take every vector register): the same instructions in the same order per output
// element as block's (block_token's, block_nested's), so a row's bits are the register blocks'.
template <typename Tiles, int C, typename Scales>
inline void amx_rows(const GemmOperands<Scales>& gemm, const uint8_t* codes8, int64_t m, int64_t b) {
  constexpr int R = 16, kEpilogueRows = 4;
  g_amx_blocks.fetch_add(1, std::memory_order_relaxed);
  const int64_t num_groups = gemm.K / gemm.weight_group_size(), sum_groups = gemm.num_sum_groups();
  const int64_t per_act_group = num_groups / gemm.num_act_groups();
  const bool nested = gemm.is_nested(), per_channel = gemm.num_weight_groups == 1;
  const bool symmetric = gemm.scales.symmetric(), int_zero_term = nested && !symmetric && gemm.has_int_zero_term();
  alignas(64) int32_t sums[C][R][16];
  // y (and a nested activation group's sum) of every row, between groups
  alignas(64) float y_rows[R][C][16], act_group_sum_rows[R][C][16];
  std::memset(y_rows, 0, sizeof(y_rows));
  const auto epilogue = [&](int64_t g) {
    if (nested && g % per_act_group == 0) std::memset(act_group_sum_rows, 0, sizeof(act_group_sum_rows));
    for (int r0 = 0; r0 < R; r0 += kEpilogueRows) {
      constexpr int E = kEpilogueRows;
      __m512i acc[E][C];  // the group's integer sums, the symmetric form's zero term in them
      __m512 y[E][C], act_group_sum[E][C];
      for (int r = 0; r < E; ++r)
        for (int c = 0; c < C; ++c) {
          acc[r][c] = _mm512_load_si512(sums[c][r0 + r]);
          if (symmetric)
            acc[r][c] = _mm512_add_epi32(
                _mm512_set1_epi32(-gemm.zero_code * gemm.code_sums[(m + r0 + r) * sum_groups + g]), acc[r][c]);
          y[r][c] = _mm512_load_ps(y_rows[r0 + r][c]);
        }
      if (!nested) {
        group_terms<E, C>(gemm, y, acc, m + r0, g, b, per_channel, symmetric);
      } else {
        for (int r = 0; r < E; ++r)
          for (int c = 0; c < C; ++c) act_group_sum[r][c] = _mm512_load_ps(act_group_sum_rows[r0 + r][c]);
        weight_group_terms<E, C>(gemm, act_group_sum, acc, m + r0, g, b, symmetric || int_zero_term);
        if (g % per_act_group == per_act_group - 1)
          activation_group_terms<E, C>(gemm, y, act_group_sum, m + r0, g / per_act_group, b, int_zero_term);
        for (int r = 0; r < E; ++r)
          for (int c = 0; c < C; ++c) _mm512_store_ps(act_group_sum_rows[r0 + r][c], act_group_sum[r][c]);
      }
      for (int r = 0; r < E; ++r)
        for (int c = 0; c < C; ++c) _mm512_store_ps(y_rows[r0 + r][c], y[r][c]);
    }
  };
  tile_group_sums<Tiles, C, 0>(gemm, codes8, m, 0);
  for (int64_t g = 1; g <= num_groups; ++g) {
    if (g % 2 == 1) {  // group g on the odd tiles while group g - 1's leave the even ones
      if (g < num_groups) tile_group_sums<Tiles, C, 1>(gemm, codes8, m, g);
      store_tile_sums<Tiles, C, 0>(sums);
    } else {
      if (g < num_groups) tile_group_sums<Tiles, C, 0>(gemm, codes8, m, g);
      store_tile_sums<Tiles, C, 1>(sums);
    }
    epilogue(g - 1);
  }
  for (int r0 = 0; r0 < R; r0 += kEpilogueRows) {
    __m512 y[kEpilogueRows][C];
    for (int r = 0; r < kEpilogueRows; ++r)
      for (int c = 0; c < C; ++c) y[r][c] = _mm512_load_ps(y_rows[r0 + r][c]);
    if (per_channel && !nested) channel_terms<kEpilogueRows, C>(gemm, y, m + r0, b, symmetric);
    store<kEpilogueRows, C>(gemm, m + r0, b, y);
  }
}

}  // namespace cpuserve_vnni
#endif
