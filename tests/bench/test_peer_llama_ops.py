"""bench/peer_llama_ops.py: the case filter it passes test-backend-ops and the times it reads from its console output
(a line as llama.cpp prints it, escape codes included). Milliseconds, not a measurement."""
from __future__ import annotations

import os
import re
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")

OUTPUT = (
    "Backend 1/1: CPU\n  Device description: AMD EPYC\n  Device memory: 24105 MB (24105 MB free)\n\n"
    "  MUL_MAT(type_a=q4_1,type_b=f32,m=4096,n=8,k=14336,bs=[1,1],nr=[1,1],per=[0,1,2,3],k_v=0,o=1,src_overlap=0,"
    "m_v=0,pad=0):                 63 runs - 17099.16 us/run - 939.52 MFLOP/run - \x1b[1;34m 54.95 GFLOPS\x1b[0m\n"
    "  MUL_MAT(type_a=q4_K,type_b=f32,m=4096,n=512,k=14336,bs=[1,1],nr=[1,1],per=[0,1,2,3],k_v=0,o=1,src_overlap=0,"
    "m_v=0,pad=0):                 2 runs - 1234567.00 us/run - 60.13 GFLOP/run - \x1b[1;34m 48.70 GFLOPS\x1b[0m\n"
    "  MUL_MAT(type_a=q1_0,type_b=f32,m=4096,n=8,k=14336,bs=[1,1],nr=[1,1],per=[0,1,2,3],k_v=0,o=1,src_overlap=0,"
    "m_v=0,pad=0): not supported\n"
    "  Backend CPU: \x1b[1;32mOK\x1b[0m\n1/1 backends passed\n"
)


@pytest.fixture(scope="module")
def ops():
    sys.path.insert(0, BENCH)
    try:
        import peer_llama_ops

        yield peer_llama_ops
    finally:
        sys.path.remove(BENCH)


def test_times_are_read_per_case_and_unsupported_cases_are_absent(ops):
    assert ops.parse_perf(OUTPUT) == {("q4_1", 4096, 8, 14336): 17.09916, ("q4_K", 4096, 512, 14336): 1234.567}


@pytest.mark.parametrize("gguf_name, rows, matches, other", [
    ("Q4_1", 8, "type_a=q4_1,type_b=f32,m=4096,n=8,k=14336,bs=[1,1]", "type_a=q4_1,type_b=f32,m=4096,n=80,k=14336,"),
    ("Q4_K", 1, "type_a=q4_K,type_b=f32,m=4096,n=1,k=14336,bs=[1,1]", "type_a=q4_K,type_b=f32,m=4096,n=1,k=143360,"),
    ("Q8_0", 512, "type_a=q8_0,type_b=f32,m=4096,n=512,k=14336,o=1", "type_a=q8_0,type_b=f16,m=4096,n=512,k=14336,"),
])
def test_the_filter_picks_one_case(ops, gguf_name, rows, matches, other):
    cmd = ops.perf_command("test-backend-ops", gguf_name, 4096, 14336, rows)
    assert cmd[:6] == ["test-backend-ops", "perf", "-b", "CPU", "-o", "MUL_MAT"]  # -b CPU: perf skips CPU otherwise
    assert re.search(cmd[-1], matches) and not re.search(cmd[-1], other)
