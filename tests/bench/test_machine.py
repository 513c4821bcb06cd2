"""bench/machine.py: the CPU line every bench table carries, and the int8 peak it measures."""
from __future__ import annotations

import importlib.util
import os

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")


def load_machine():
    spec = importlib.util.spec_from_file_location("cpuserve_bench_machine", os.path.join(BENCH, "machine.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_zen_generations_told_apart():
    m = load_machine()
    assert m.uarch("AuthenticAMD", 25, 17) == "Zen 4"   # EPYC 9004 (Genoa)
    assert m.uarch("AuthenticAMD", 25, 0xA0) == "Zen 4"  # EPYC 97x4 (Bergamo)
    assert m.uarch("AuthenticAMD", 25, 1) == "Zen 3"     # EPYC 7003 (Milan)
    assert m.uarch("AuthenticAMD", 26, 2) == "Zen 5"     # EPYC 9005 (Turin)
    assert m.uarch("GenuineIntel", 6, 0x8F) == ""        # Intel's model name says it


def test_describe_names_this_cpu_and_its_peak():
    m = load_machine()
    c = m.cpu()
    with open("/proc/cpuinfo") as f:
        name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    assert c["name"] == name
    peak = m.int8_peak_gmacs()
    line = m.describe(peak)
    assert line.startswith(f"CPU {name} (family {c['family']} model {c['model']}")
    assert ("no AMX" in line) == ("amx_int8" not in c["flags"])
    if "avx512_vnni" not in c["flags"]:
        assert peak is None
        return
    # one or two 512-bit vpdpbusd a cycle (64 multiply-adds each) at a clock of 1-6 GHz, on a possibly shared core
    assert peak is not None and 10 < peak < 2 * 64 * 6, peak
    assert f"peak {peak:.0f} G multiply-adds/s a core" in line
