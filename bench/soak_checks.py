"""The soak's checks (bench/soak.py): each returns (name, passed, detail)."""
from __future__ import annotations

import time

import httpx

from soak_clients import GREEDY_TOKENS, Result

MODEL = 'model="SmolLM2-135M-Instruct"'
MAX_GROWTH = 0.05  # RssAnon + VmSwap, from the baseline to the end
# ... or this much: Ray's small daemons (raylet ~12 MiB) move by a MiB or two as their allocators warm up, where 5%
# is under a MiB; a per-request leak grows with the requests, past this in a long run
NOISE_KB = 2048


def scrape(port: int) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def check_outcomes(results: list[Result]) -> tuple[str, bool, str]:
    bad = [r for r in results if r.outcome in ("failed", "hung")]
    detail = f"{len(results)} requests; {len(bad)} failed or hung"
    if bad:
        detail += ": " + "; ".join(sorted({f"{r.proto} {r.outcome}: {r.detail}" for r in bad})[:5])
    return "outcomes", not bad, detail


def check_greedy(results: list[Result], prompts: list[str]) -> tuple[str, bool, str]:
    """Completed greedy samples against the engine alone (as a single-rank replica runs it, one thread)."""
    from cpuserve.engine.llm import LLM
    from cpuserve.engine.sampling_params import SamplingParams

    llm = LLM(weights="int4", kv_cache="int8", kv_cache_gb=0.1, num_threads=1, show_progress=False)
    alone = llm.generate(prompts, SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0, ignore_eos=True))
    ids = [a.token_ids for a in alone]
    texts = ["".join(llm.tokenizer.decode([t], skip_special_tokens=False) for t in a) for a in ids]
    done = [r for r in results if r.greedy is not None and r.outcome == "completed"]
    wrong = [r for r in done if (r.ids != ids[r.greedy] if r.proto == "grpc" else r.text != texts[r.greedy])]
    by_proto = {p: sum(r.proto == p for r in done) for p in ("grpc", "http")}
    detail = f"{by_proto['grpc']} gRPC (tokens) and {by_proto['http']} HTTP (text) samples; {len(wrong)} differ"
    return "greedy = engine alone", bool(done) and not wrong, detail


def check_kv_free(port: int, timeout: float = 60) -> tuple[str, bool, str]:
    """Once the clients are gone: no block used, nothing running or waiting (replicas report every 0.5 s)."""
    names = ("cpuserve_kv_cache_usage_ratio", "cpuserve_num_requests_running", "cpuserve_num_requests_waiting")
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(port)
        values = {n: m.get(f"{n}{{{MODEL}}}") for n in names}
        if all(v == 0 for v in values.values()) or time.monotonic() > deadline:
            return "KV pool free", all(v == 0 for v in values.values()), ", ".join(f"{n} {v}" for n, v in values.items())


def check_metrics_settled(port: int, before: dict[str, float], results: list[Result], timeout: float = 30
                          ) -> tuple[str, bool, str]:
    """check_metrics against scrapes until it passes or `timeout` passes. The ingress counts a request when its
    stream's cleanup runs: for a client that left at the end, that is after the client has counted it (a gRPC
    cancellation reaches the handler, or an HTTP disconnect is noticed within 0.5 s, on a loaded event loop)."""
    start = time.monotonic()
    while True:
        name, same, detail = check_metrics(before, scrape(port), results)
        waited = time.monotonic() - start
        if same or waited > timeout:
            return name, same, detail + (f" (after {waited:.0f} s)" if waited >= 1 else "")
        time.sleep(1)


def check_metrics(before: dict[str, float], after: dict[str, float], results: list[Result]) -> tuple[str, bool, str]:
    """The server's counters moved as the client counted: finished (stop + length), aborted (cancelled, deadline),
    errors (failed), refused (both limits)."""
    def delta(name: str, labels: str) -> float:
        key = f"{name}{{{labels}}}"
        return after.get(key, 0) - before.get(key, 0)

    requests = lambda reason: delta("cpuserve_requests_total", f'finish_reason="{reason}",{MODEL}')  # noqa: E731
    server = {"completed": requests("stop") + requests("length"), "cancelled": requests("abort"),
              "failed": requests("error"),
              "refused": sum(delta("cpuserve_requests_refused_total", f'limit="{k}",{MODEL}') for k in
                             ("requests", "tokens"))}
    count = lambda *outcomes: sum(r.outcome in outcomes for r in results)  # noqa: E731
    client = {"completed": count("completed"), "cancelled": count("cancelled", "deadline"),
              "failed": count("failed", "hung"), "refused": count("refused")}
    # a client that left before any token came may have left before its request reached the ingress (a gRPC
    # deadline of 0.3 s passing in the server's queue, or a request still queued when the run ends): the ingress
    # never counted it
    unseen = sum(r.outcome in ("cancelled", "deadline") and not r.tokens for r in results)
    detail = ", ".join(f"{k}: server {server[k]:g} / client {client[k]}" for k in client)
    if unseen:
        detail += f" ({unseen} left before their first token)"
    # a client that left may have left after the server sent its last token (still unread in the socket): the
    # server counts it finished, the client cancelled; every other count is exact
    ended = server["completed"] + server["cancelled"]
    same = server["failed"] == client["failed"] and server["refused"] == client["refused"] and \
        client["completed"] + client["cancelled"] - unseen <= ended <= client["completed"] + client["cancelled"] and \
        client["completed"] <= server["completed"] <= client["completed"] + client["cancelled"]
    return "metrics = client", same, detail


def low_water(samples: list[tuple[float, dict[int, tuple[str, int]]]], start: float, stop: float
              ) -> dict[int, tuple[str, int]]:
    """pid -> (name, the least kB sampled between start and stop seconds) of the processes in every such sample."""
    window = [mem for t, mem in samples if start <= t <= stop]
    pids = set.intersection(*(set(mem) for mem in window)) if window else set()
    return {pid: (window[0][pid][0], min(mem[pid][1] for mem in window)) for pid in pids}


def check_memory(samples: list[tuple[float, dict[int, tuple[str, int]]]], window_s: float,
                 min_kb: int = 0) -> tuple[str, bool, str]:
    """Each process alive from the first sample (the baseline) to the last and holding min_kb at the baseline: its
    low-water mark (RssAnon + VmSwap) over the last window_s of samples grew less than MAX_GROWTH (or than NOISE_KB)
    from the one over the first window_s. The point-to-point growth (first sample to last) is shown beside it."""
    first_t, last_t = samples[0][0], samples[-1][0]
    baseline = low_water(samples, first_t, first_t + window_s)
    end = low_water(samples, last_t - window_s, last_t)
    first, last = samples[0][1], samples[-1][1]
    both = [(pid, baseline[pid][0], baseline[pid][1], end[pid][1]) for pid in baseline
            if pid in end and pid in first and first[pid][1] >= min_kb]
    growth = sorted(((e - b) / b if b else 0.0, name, pid, b, e) for pid, name, b, e in both)
    over = [g for g in growth if g[0] >= MAX_GROWTH and g[4] - g[3] >= NOISE_KB]
    worst = growth[-3:][::-1]

    def point(pid: int) -> str:
        b, e = first[pid][1], last.get(pid, (None, 0))[1]
        return f"; one sample each {b / 1024:.0f} -> {e / 1024:.0f}" if pid in last else ""

    detail = (f"{len(both)} processes" + (f" of {min_kb // 1024} MiB or more" if min_kb else "")
              + f"; low-water marks over {window_s:.0f} s, largest growth: " + "; ".join(
                  f"{name} {b / 1024:.0f} -> {e / 1024:.0f} MiB ({g:+.1%}{point(pid)})" for g, name, pid, b, e in worst))
    gone = len(samples[0][1]) - len(both) - sum(1 for pid in first if first[pid][1] < min_kb)
    if gone:
        detail += f"; {gone} process(es) of the baseline ended"
    return "memory (RssAnon+VmSwap)", bool(both) and not over, detail
