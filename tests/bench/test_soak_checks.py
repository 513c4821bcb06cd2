"""The soak's checks (bench/soak_checks.py) on made-up input. Memory: a process whose garbage collector swings it
like a sawtooth passes whatever phase the last sample catches; one that leaks fails, however its samples fall.
Metrics: the server's counters may miss only requests their clients left before a token came."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
from soak_checks import MODEL, check_memory, check_metrics  # noqa: E402
from soak_clients import Result  # noqa: E402

MIB = 1024  # kB


def run(kb_at) -> list[tuple[float, dict[int, tuple[str, int]]]]:
    """Samples every 30 s of one process, pid 7, from the baseline at minute 2 to minute 26.5."""
    return [(t, {7: ("ray::ServeReplica:cpuserve:Ingress", kb_at(t))}) for t in range(120, 1591, 30)]


def sawtooth(t: float) -> int:  # 100 MiB at the baseline, climbing 6 MiB over 5 minutes, then collected
    return round((100 + 6 * ((t - 120) % 300) / 300) * MIB)


def test_a_sawtooth_passes_even_when_the_last_sample_is_at_its_peak():
    samples = run(sawtooth)
    assert samples[-1][1][7][1] > 1.05 * samples[0][1][7][1]  # one sample each end would call this +5.4%
    name, ok, detail = check_memory(samples, 300)
    assert ok, detail
    assert "Ingress 100 -> 100 MiB" in detail and "one sample each 100 -> 105" in detail


def test_a_leak_fails_with_its_growth_named():
    leak = run(lambda t: sawtooth(t) + round(8 * MIB * t / 1800))  # the same swing over 8 MiB lost in the run
    name, ok, detail = check_memory(leak, 300)
    assert not ok and name == "memory (RssAnon+VmSwap)"
    assert "Ingress" in detail


def test_a_small_daemon_moving_by_a_mib_passes_and_one_past_the_noise_allowance_fails():
    daemon = [(t, {9: ("raylet", round((12 + (t > 900)) * MIB))}) for t in range(120, 1801, 30)]
    assert check_memory(daemon, 300)[1]
    creeping = [(t, {9: ("raylet", round((12 + 4 * t / 1800) * MIB))}) for t in range(120, 1801, 30)]
    ok, detail = check_memory(creeping, 300)[1:]
    assert not ok and "raylet" in detail


def counters(completed: int, aborted: int) -> dict[str, float]:
    return {f'cpuserve_requests_total{{finish_reason="length",{MODEL}}}': completed,
            f'cpuserve_requests_total{{finish_reason="abort",{MODEL}}}': aborted}


def test_the_server_may_miss_only_requests_left_before_their_first_token():
    results = [Result("grpc", "stream", "completed", tokens=5)] * 3 + [Result("grpc", "stream", "deadline")] + \
        [Result("http", "stream", "cancelled", tokens=2)]
    assert check_metrics({}, counters(3, 2), results)[1]  # every request counted
    assert check_metrics({}, counters(4, 1), results)[1]  # the cancelled one had finished on the server
    name, ok, detail = check_metrics({}, counters(3, 1), results)  # the deadline's never reached the ingress
    assert ok and "1 left before their first token" in detail, detail
    assert not check_metrics({}, counters(2, 2), results)[1]  # a completed request uncounted
    assert not check_metrics({}, counters(3, 0), results)[1]  # so is one that had streamed tokens
    assert not check_metrics({}, counters(3, 3), results)[1]  # one more than the clients sent
