// AMX int8 tiles for the dot-product GEMMs (vnni_gemm.cpp), and a software model of them.
//
// A Xeon with AMX (Sapphire Rapids and later) multiplies a 16 x K/4 tile of 4-byte groups by a K/4 x 16 one in one
// instruction: 16 x 16 x 64 int8 multiply-adds, against 16 x 4 for a vpdpbusd. The GEMMs' codes already lie in the
// layout a B tile wants (vnni_layouts.h: per 4 inputs, 64 bytes of 16 columns x 4 codes), and each activation row's
// codes are a row of an A tile. TDPBSUD takes signed bytes on A (the activations) and unsigned ones on B (the codes),
// as vpdpbusd takes them the other way round; both sum exactly into int32.
//
// Two implementations of the same five operations:
//   AmxHw   the instructions themselves (inline assembly: no -mamx flags needed to build; only run where
//           amx_hw_available() said yes, which also asks Linux for the tile state, ARCH_REQ_XCOMP_PERM).
//   AmxEmu  a model of them in ordinary code, after the instruction set reference: per-thread tiles of 16 rows x 64
//           bytes, the palette-1 configuration's rows and column bytes, TILELOADD / TILESTORED with a stride,
//           TILEZERO, TDPBSUD and TDPBF16PS, refusing the shape combinations on which the hardware faults. The tests
//           run the AMX paths of the GEMMs through it on CPUs without AMX, so their addressing, configuration and
//           epilogues are checked everywhere; only the mapping of these calls to instructions needs the hardware (and
//           TDPBF16PS's rounding, which the model does not reproduce: see AmxEmu::dpbf16ps).
#pragma once

#include <ATen/ATen.h>

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

namespace cpuserve_amx {

// LDTILECFG's 64-byte operand, palette 1: tile t is rows[t] rows of colsb[t] bytes (at most 16 x 64)
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  void set(int t, int r, int c) { rows[t] = static_cast<uint8_t>(r), colsb[t] = static_cast<uint16_t>(c); }
};
static_assert(sizeof(TileConfig) == 64, "LDTILECFG reads 64 bytes");

// The CPU has AMX-TILE and AMX-INT8 (CPUID.7.0:EDX bits 24, 25) and Linux gave this process the tile state
inline bool amx_hw_available() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 24) & 1) || !((d >> 25) & 1)) return false;
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;  // asm/prctl.h, the XTILEDATA state component
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
}

// The CPU has AMX-TILE and AMX-BF16 (CPUID.7.0:EDX bits 24, 22) and Linux gave this process the tile state
inline bool amx_bf16_hw_available() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 24) & 1) || !((d >> 22) & 1)) return false;
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
}

#define CPUSERVE_TILE_OP(T, code)                      \
  if constexpr (T == 0) { code("0"); }                 \
  else if constexpr (T == 1) { code("1"); }            \
  else if constexpr (T == 2) { code("2"); }            \
  else if constexpr (T == 3) { code("3"); }            \
  else if constexpr (T == 4) { code("4"); }            \
  else if constexpr (T == 5) { code("5"); }            \
  else if constexpr (T == 6) { code("6"); }            \
  else { static_assert(T == 7, "tiles are tmm0-tmm7"); code("7"); }

struct AmxHw {
  static void config(const TileConfig& cfg) { asm volatile("ldtilecfg %0" ::"m"(cfg)); }
  static void release() { asm volatile("tilerelease" ::); }
  template <int T>
  static void zero() {
#define CPUSERVE_TZ(n) asm volatile("tilezero %%tmm" n ::)
    CPUSERVE_TILE_OP(T, CPUSERVE_TZ)
#undef CPUSERVE_TZ
  }
  template <int T>
  static void load(const void* base, int64_t stride) {
#define CPUSERVE_TL(n) asm volatile("tileloadd (%0,%1,1), %%tmm" n ::"r"(base), "r"(stride) : "memory")
    CPUSERVE_TILE_OP(T, CPUSERVE_TL)
#undef CPUSERVE_TL
  }
  template <int T>
  static void store(void* base, int64_t stride) {
#define CPUSERVE_TS(n) asm volatile("tilestored %%tmm" n ", (%0,%1,1)" ::"r"(base), "r"(stride) : "memory")
    CPUSERVE_TILE_OP(T, CPUSERVE_TS)
#undef CPUSERVE_TS
  }
  // tile C += tile A (signed bytes) . tile B (unsigned bytes). AT&T order: B, A, C.
  template <int C, int A, int B>
  static void dpbsud() {
    static_assert(C == 0 || C == 1 || C == 5 || C == 6, "the GEMMs' sums are tmm0-1 and tmm5-6");
    static_assert(A == 2 && (B == 3 || B == 4), "the GEMMs' operands are tmm2 (activations), tmm3 and tmm4 (codes)");
    if constexpr (C == 0 && B == 3) asm volatile("tdpbsud %%tmm3, %%tmm2, %%tmm0" ::);
    else if constexpr (C == 0) asm volatile("tdpbsud %%tmm4, %%tmm2, %%tmm0" ::);
    else if constexpr (C == 1 && B == 3) asm volatile("tdpbsud %%tmm3, %%tmm2, %%tmm1" ::);
    else if constexpr (C == 1) asm volatile("tdpbsud %%tmm4, %%tmm2, %%tmm1" ::);
    else if constexpr (C == 5 && B == 3) asm volatile("tdpbsud %%tmm3, %%tmm2, %%tmm5" ::);
    else if constexpr (C == 5) asm volatile("tdpbsud %%tmm4, %%tmm2, %%tmm5" ::);
    else if constexpr (B == 3) asm volatile("tdpbsud %%tmm3, %%tmm2, %%tmm6" ::);
    else asm volatile("tdpbsud %%tmm4, %%tmm2, %%tmm6" ::);
  }
  // tile C += tile A (bf16 pairs) . tile B (bf16 pairs), fp32 sums: amx_bf16_gemm.cpp's sums (tmm0-3) of its
  // activations (tmm4, tmm5) and weights (tmm6, tmm7). AT&T order: B, A, C.
  template <int C, int A, int B>
  static void dpbf16ps() {
    static_assert(C >= 0 && C < 4 && (A == 4 || A == 5) && (B == 6 || B == 7), "sums tmm0-3, A tmm4-5, B tmm6-7");
#define CPUSERVE_DPBF(c, a, b)                                                      \
  if constexpr (C == c && A == a && B == b) {                                       \
    asm volatile("tdpbf16ps %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::);                \
    return;                                                                         \
  }
    CPUSERVE_DPBF(0, 4, 6) CPUSERVE_DPBF(1, 4, 7) CPUSERVE_DPBF(2, 5, 6) CPUSERVE_DPBF(3, 5, 7)
#undef CPUSERVE_DPBF
    static_assert(C == (A - 4) * 2 + (B - 6), "the combinations amx_bf16_gemm.cpp uses");
  }
};
#undef CPUSERVE_TILE_OP

struct AmxEmu {
  struct Tile {
    int rows = 0, colsb = 0;
    uint8_t data[16][64] = {};
  };
  static Tile* tiles() {
    thread_local Tile t[8];
    return t;
  }
  static void config(const TileConfig& cfg) {
    TORCH_CHECK(cfg.palette == 1 && cfg.start_row == 0, "AMX: palette 1 from row 0 only");
    for (int t = 0; t < 8; ++t) {
      TORCH_CHECK(cfg.rows[t] <= 16 && cfg.colsb[t] <= 64 && (cfg.rows[t] == 0) == (cfg.colsb[t] == 0),
                  "AMX: tile ", t, " configured as ", int(cfg.rows[t]), " x ", cfg.colsb[t], " bytes");
      tiles()[t] = Tile{cfg.rows[t], cfg.colsb[t]};
    }
  }
  static void release() {
    for (int t = 0; t < 8; ++t) tiles()[t] = Tile{};
  }
  template <int T>
  static void zero() {
    std::memset(tiles()[T].data, 0, sizeof(Tile::data));
  }
  template <int T>
  static void load(const void* base, int64_t stride) {  // the configured rows and bytes; the rest of the tile zeroed
    Tile& t = tiles()[T];
    TORCH_CHECK(t.rows > 0, "AMX: tile ", T, " loaded while unconfigured");
    std::memset(t.data, 0, sizeof(Tile::data));
    for (int r = 0; r < t.rows; ++r) std::memcpy(t.data[r], static_cast<const uint8_t*>(base) + r * stride, t.colsb);
  }
  template <int T>
  static void store(void* base, int64_t stride) {
    const Tile& t = tiles()[T];
    TORCH_CHECK(t.rows > 0, "AMX: tile ", T, " stored while unconfigured");
    for (int r = 0; r < t.rows; ++r) std::memcpy(static_cast<uint8_t*>(base) + r * stride, t.data[r], t.colsb);
  }
  template <int C, int A, int B>
  static void dpbsud() {
    Tile &c = tiles()[C], &a = tiles()[A], &b = tiles()[B];
    // the shapes TDPBSUD accepts (else #UD): C is A's rows x B's columns, B has a row per 4 bytes of A's
    TORCH_CHECK(c.rows == a.rows && b.rows * 4 == a.colsb && c.colsb == b.colsb && c.colsb % 4 == 0 && a.colsb % 4 == 0,
                "AMX: TDPBSUD on tiles of ", c.rows, "x", c.colsb, ", ", a.rows, "x", a.colsb, ", ", b.rows, "x", b.colsb);
    for (int m = 0; m < c.rows; ++m)
      for (int n = 0; n < c.colsb / 4; ++n) {
        int32_t sum;
        std::memcpy(&sum, c.data[m] + 4 * n, 4);
        for (int k = 0; k < b.rows; ++k)
          for (int i = 0; i < 4; ++i)
            sum += int32_t(static_cast<int8_t>(a.data[m][4 * k + i])) * int32_t(b.data[k][4 * n + i]);
        std::memcpy(c.data[m] + 4 * n, &sum, 4);
      }
  }
  // TDPBF16PS after the instruction set reference's pseudo-code: per output, for each pair in order, the even then
  // the odd product added to the fp32 sum (each product of two bf16 is exact in fp32), rounding to nearest even;
  // denormal inputs and results are zero. The hardware's own rounding inside one instruction is not documented and
  // differs: on a Xeon with AMX, 60% of random sums came out one step apart from this order and from three other
  // orders tried. So this model checks the addressing and tile shapes, held to the reference's bound, not to the
  // hardware's bits (tests/engine/test_amx_bf16_gemm.py).
  template <int C, int A, int B>
  static void dpbf16ps() {
    Tile &c = tiles()[C], &a = tiles()[A], &b = tiles()[B];
    TORCH_CHECK(c.rows == a.rows && b.rows * 4 == a.colsb && c.colsb == b.colsb && c.colsb % 4 == 0 && a.colsb % 4 == 0,
                "AMX: TDPBF16PS on tiles of ", c.rows, "x", c.colsb, ", ", a.rows, "x", a.colsb, ", ", b.rows, "x", b.colsb);
    const auto bf16 = [](const uint8_t* p) {
      uint32_t bits = uint32_t(p[0]) << 16 | uint32_t(p[1]) << 24;
      if ((bits & 0x7F800000u) == 0) bits &= 0x80000000u;  // a denormal input is zero
      float f;
      std::memcpy(&f, &bits, 4);
      return f;
    };
    const auto flush = [](float f) {
      uint32_t bits;
      std::memcpy(&bits, &f, 4);
      if ((bits & 0x7F800000u) == 0) bits &= 0x80000000u;
      std::memcpy(&f, &bits, 4);
      return f;
    };
    for (int m = 0; m < c.rows; ++m)
      for (int n = 0; n < c.colsb / 4; ++n) {
        float sum;
        std::memcpy(&sum, c.data[m] + 4 * n, 4);
        for (int k = 0; k < b.rows; ++k)
          for (int i = 0; i < 2; ++i) {
            const volatile float product = bf16(a.data[m] + 4 * k + 2 * i) * bf16(b.data[k] + 4 * n + 2 * i);
            sum = flush(sum + product);
          }
        std::memcpy(c.data[m] + 4 * n, &sum, 4);
      }
  }
};

}  // namespace cpuserve_amx
