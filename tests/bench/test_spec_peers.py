"""bench/speculative.py's llama-server peer (bench/spec_peers.py): its timings aggregated as cpuserve's are, the
table's ratios and verdict, and one real llama-server batch with ngram-simple where the binary is built.

Seconds, not a measurement.
"""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, BENCH)  # spec_peers, serve_servers, peer_llama_server
    try:
        spec = importlib.util.spec_from_file_location("cpuserve_bench_speculative",
                                                      os.path.join(BENCH, "speculative.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        import peer_llama_server
        import spec_peers

        yield module, spec_peers, peer_llama_server
    finally:
        sys.path.remove(BENCH)


def _answer(n: int, ms: float, tokens: list[int], **draft) -> dict:
    return {"tokens": tokens, "timings": {"predicted_n": n, "predicted_ms": ms, **draft}}


def test_a_batch_counts_tokens_after_the_first_over_the_span_they_cover(bench):
    _, spec_peers, _ = bench
    one = spec_peers.aggregate([(10.0, _answer(101, 2000.0, [1] * 101, draft_n=60, draft_n_accepted=45))])
    assert one[:2] == (pytest.approx(2.0), 100)  # exactly (predicted_n - 1) / predicted_ms at one stream
    assert one[3:] == (60, 45)
    # two streams: the first starts decoding at 8.0 and ends at 10.0, the second 7.5 .. 9.0: span 7.5 .. 10.0
    two = spec_peers.aggregate([(10.0, _answer(41, 2000.0, [1])), (9.0, _answer(31, 1500.0, [2]))])
    assert two[0] == pytest.approx(2.5) and two[1] == 70
    assert two[2] == [[1], [2]] and two[3:] == (0, 0)  # no draft_n in the timings: nothing drafted


def _stats(speeds: dict[str, list[float]]) -> dict:
    return {label: {"speed": s, "drafted": 100, "accepted": 50, "same": [6, 6]} for label, s in speeds.items()}


def test_rows_give_each_engines_own_ratio_and_compare_with_the_best_peer(bench):
    speculative, _, _ = bench
    stats = _stats({"cpuserve off": [100, 50, 100], "cpuserve ngram": [200, 100, 180],
                    "llama-server off": [80, 80, 80], "llama-server ngram-simple": [100, 96, 120],
                    "llama-server ngram-mod": [88, 88, 88]})
    rows = speculative.rows("copy-heavy", 1, stats, {})
    assert len(rows) == 4
    assert rows[0].split()[4:] == ["100.0", "180.0", "2.00", "50%", "6/6"]  # median of per-repetition ratios
    assert "1.25" in rows[1].split() and "1.10" in rows[2].split()
    assert "cpuserve ngram 2.00x vs llama-server ngram-simple 1.25x: ahead; target >= 1.8x and ahead: met" in rows[3]
    slow = dict(stats, **_stats({"cpuserve ngram": [120, 60, 120]}))  # 1.20x against llama-server's 1.25x
    assert "1.20x vs llama-server ngram-simple 1.25x: behind; target >= 1.8x and ahead: missed" in \
        speculative.rows("copy-heavy", 1, slow, {})[3]
    failed = speculative.rows("open chat", 8, stats, {"llama-server ngram-mod": "RuntimeError: no binary"})
    assert "failed: RuntimeError: no binary" in failed[2] and "target" not in failed[3]


@pytest.mark.slow  # the real model on a real llama-server
def test_a_real_llama_server_batch_drafts_with_ngram_simple(bench):
    speculative, spec_peers, peer_llama_server = bench
    if not os.access(peer_llama_server.binary(), os.X_OK):
        pytest.skip(f"llama-server is not built ({peer_llama_server.binary()}): `python bench/peer_llama_server.py` "
                    "builds it (~10 min); tests never build it")
    from cpuserve.engine.loader import default_model_path, load_checkpoint

    tok = load_checkpoint(default_model_path(), show_progress=False).tokenizer  # the engine's, from the GGUF
    text = speculative.COPY_HEAVY[3]  # summarise a tool result: SmolLM2 repeats the JSON
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)
    seconds, decoded, outputs, drafted, accepted = spec_peers.run(
        "ngram-simple", default_model_path(), 2, 1, [prompt], max_tokens=64)
    assert len(outputs) == 1 and len(outputs[0]) > 1
    assert decoded == sum(len(o) - 1 for o in outputs) and seconds > 0
    assert drafted > 0 and 0 < accepted <= drafted  # its 12-token lookups find the prompt
