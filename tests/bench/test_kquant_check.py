"""bench/kquant_check.py: SmolLM2 quantized by llama.cpp itself to Q4_K_M and Q6_K, cpuserve's perplexity against
llama.cpp's own on the same file (its logits) and against fp32. Needs llama.cpp (the bench extra); 2048 tokens."""
from __future__ import annotations

import importlib.util
import os

import pytest

pytest.importorskip("llama_cpp", reason="needs llama.cpp: pip install -e '.[bench]' (compiles it, ~10 minutes)")
pytestmark = pytest.mark.slow


def test_llama_cpp_made_k_quants_score_as_llama_cpp_scores_them(tmp_path):
    path = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "kquant_check.py")
    spec = importlib.util.spec_from_file_location("kquant_check", path)
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    results = check.run(str(tmp_path), 2048)
    print(results)
    for recipe in check.RECIPES:
        assert abs(results[recipe]["vs_llama.cpp"]) <= 0.01, (recipe, results[recipe])
    assert results["Q6_K"]["vs_fp32"] <= 0.02
    # Q4_K_M's own loss is the file's: llama.cpp measures it too; ours stays within 1% of that
    assert results["Q4_K_M"]["vs_fp32"] <= results["Q4_K_M"]["llama.cpp_vs_fp32"] + 0.01
    assert results["Q4_K_M"]["types"]["Q4_K"] > 0 and results["Q6_K"]["types"]["Q6_K"] > 0
