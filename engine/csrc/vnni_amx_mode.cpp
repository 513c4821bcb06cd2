// Whether the int8 GEMMs' AMX path (vnni_amx_rows.h) runs, on the instructions or on their software model (the
// tests' way to run it on a CPU without AMX), and how many 16-row blocks it has taken: the ops vnni_gemm_amx and
// vnni_gemm_amx_blocks.

#include <ATen/ATen.h>
#include <torch/library.h>

#include "amx_tiles.h"
#include "vnni_amx_rows.h"

#include <cstdint>
#include <string>

namespace {

// The AMX path's mode: mode "off", "auto" (the instructions where the CPU and Linux give them) or "emulate" (their
// software model: tests), or "" to keep it; returns the mode in force: "off", "hw" or "emulate"
std::string vnni_gemm_amx(const std::string& mode) {
  TORCH_CHECK(mode.empty() || mode == "off" || mode == "auto" || mode == "emulate",
              "vnni_gemm_amx: mode must be off, auto or emulate, got ", mode);
  static const char* const kNames[] = {"off", "hw", "emulate"};
#if defined(CPUSERVE_VNNI)
  using cpuserve_vnni::g_amx_mode;
  if (mode == "off") g_amx_mode = 0;
  if (mode == "emulate") g_amx_mode = 2;
  if (mode == "auto") g_amx_mode = cpuserve_amx::amx_hw_available() ? 1 : 0;
  return kNames[cpuserve_vnni::amx_mode()];
#else
  return kNames[0];  // the tiles belong to the AVX-512 build
#endif
}

int64_t vnni_gemm_amx_blocks() {
#if defined(CPUSERVE_VNNI)
  return cpuserve_vnni::g_amx_blocks.load();
#else
  return 0;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cpuserve, m) {
  m.def("vnni_gemm_amx(str mode=\"\") -> str");
  m.def("vnni_gemm_amx_blocks() -> int");
}

TORCH_LIBRARY_IMPL(cpuserve, CompositeExplicitAutograd, m) {
  m.impl("vnni_gemm_amx", &vnni_gemm_amx);
  m.impl("vnni_gemm_amx_blocks", &vnni_gemm_amx_blocks);
}
