"""Which CPU a benchmark ran on, and the int8 dot-product rate one of its cores can reach.

"AMD EPYC" names more than one machine: a Zen 4 core (family 25) runs a 512-bit vpdpbusd once a cycle, a Zen 5 core
(family 26) twice, so the same build measures twice as fast on one as on the other, GEMMs and peers alike. Every
bench table says which it ran on, and measures the peak it should be read against:

    python bench/machine.py          # the CPU line and the vpdpbusd peak of one core
"""
from __future__ import annotations

import os
import subprocess
import tempfile

# AMD's family 25 (0x19) holds Zen 3 and Zen 4, told apart by model; 26 (0x1A) is Zen 5
_ZEN4_MODELS = (range(0x10, 0x20), range(0x60, 0x80), range(0xA0, 0xB0))
_FLAGS = ("avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")

# 12 independent accumulators in registers, one 512-bit vpdpbusd each per pass: the instruction's rate, not a chain's
_PEAK_SOURCE = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdio>
int main() {
  __m512i acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_epi32(i);
  __m512i a = _mm512_set1_epi32(0x01010101), b = _mm512_set1_epi32(0x02020202);
  const long passes = 20000000;
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    for (long n = 0; n < passes; ++n) {
#pragma GCC unroll 12
      for (int i = 0; i < 12; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
      asm volatile("" : "+v"(a));
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = best > passes * 12 * 64 / s ? best : passes * 12 * 64 / s;
  }
  int sink = 0;
  for (int i = 0; i < 12; ++i) sink += _mm512_reduce_add_epi32(acc[i]);
  std::printf("%.1f %d\n", best / 1e9, sink & 1);
}
"""


def cpu() -> dict:
    """Model name, family/model, the microarchitecture where it is known, and the flags the kernels care about."""
    info: dict[str, str] = {}
    with open("/proc/cpuinfo") as f:
        for line in f:
            if not line.strip():
                break  # the first processor's block
            key, _, value = line.partition(":")
            info[key.strip()] = value.strip()
    family, model = int(info.get("cpu family", "0")), int(info.get("model", "0"))
    flags = set(info.get("flags", "").split())
    return dict(name=info.get("model name", "?"), family=family, model=model,
                uarch=uarch(info.get("vendor_id", ""), family, model), flags=[f for f in _FLAGS if f in flags])


def has_amx() -> bool:
    """The CPU reports AMX tiles with int8 and bf16 products (the kernels' tile paths can run)."""
    return {"amx_tile", "amx_int8", "amx_bf16"} <= set(cpu()["flags"])


def uarch(vendor: str, family: int, model: int) -> str:
    """AMD's Zen generation from /proc/cpuinfo's vendor, family and model; "" where not known (Intel's model name
    says enough)."""
    if vendor != "AuthenticAMD":
        return ""
    if family == 26:
        return "Zen 5"
    if family == 25:
        return "Zen 4" if any(model in r for r in _ZEN4_MODELS) else "Zen 3"
    return ""


def int8_peak_gmacs() -> float | None:
    """G multiply-adds a second of 512-bit vpdpbusd on one core (a register-only loop, compiled here), or None where
    the CPU has no AVX-512 VNNI or no C++ compiler is found."""
    if "avx512_vnni" not in cpu()["flags"]:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = os.path.join(tmp, "peak.cpp"), os.path.join(tmp, "peak")
        with open(src, "w") as f:
            f.write(_PEAK_SOURCE)
        try:
            subprocess.run([os.environ.get("CXX", "g++"), "-O2", "-march=native", "-o", exe, src], check=True,
                           capture_output=True)
        except (OSError, subprocess.CalledProcessError):
            return None
        pin = ["taskset", "-c", str(min(os.sched_getaffinity(0)))] if _has("taskset") else []
        out = subprocess.run([*pin, exe], check=True, capture_output=True, text=True).stdout
    return float(out.split()[0])


def _has(tool: str) -> bool:
    return any(os.access(os.path.join(d, tool), os.X_OK) for d in os.environ.get("PATH", "").split(os.pathsep))


def describe(peak: float | None = None) -> str:
    """One line: the CPU, its flags, and (when given) the measured int8 peak of a core."""
    c = cpu()
    ident = f"family {c['family']} model {c['model']}" + (f", {c['uarch']}" if c["uarch"] else "")
    amx = "AMX" if "amx_int8" in c["flags"] else "no AMX"
    flags = ", ".join(f for f in c["flags"] if not f.startswith("amx")) or "no AVX-512 VNNI/BF16"
    line = f"CPU {c['name']} ({ident}): {flags}, {amx}"
    if peak is not None:
        line += f"; 512-bit vpdpbusd peak {peak:.0f} G multiply-adds/s a core"
    return line


if __name__ == "__main__":
    print(describe(int8_peak_gmacs()))
