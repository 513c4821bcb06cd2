"""llama.cpp's llama-server and its own n-gram speculation, as a peer of bench/speculative.py.

Three ways, draft sizes at llama.cpp's defaults: no speculation, `--spec-type ngram-simple` (looks up the last 12
tokens in the request's own tokens, drafts up to 48) and `--spec-type ngram-mod` (one hash pool of 24-token n-grams
shared by all slots, drafts 48 to 64). Each batch of bench/speculative.py runs on a llama-server started for it
(serve_servers.llamacpp_server, the one launcher of bench/, `-np` = the streams measured) and stopped after it:
ngram-mod's pool lives as long as the server, so a server kept across batches would draft one run's output for
the next, where cpuserve empties its prefix cache between runs.

The requests are the same token ids cpuserve gets (its chat template applied) on llama-server's /completion, all of
a batch at once, greedy (temperature 0), n_predict = max tokens, no prompt cache. The speed comes from llama-server's
own per-request timings: predicted_n - 1 tokens after the first one in predicted_ms; a batch's seconds are the wall
span those intervals cover (from the earliest first token to the last response, each request's start placed at its
response's arrival minus its predicted_ms), so one stream gives exactly (predicted_n - 1) / predicted_ms. Drafted
and accepted tokens are the timings' draft_n and draft_n_accepted.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from serve_servers import llamacpp_server

MODES = {"off": [], "ngram-simple": ["--spec-type", "ngram-simple"], "ngram-mod": ["--spec-type", "ngram-mod"]}


def complete(url: str, prompt: list[int], max_tokens: int) -> tuple[float, dict]:
    """(arrival time, /completion's answer) of one greedy request."""
    body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "cache_prompt": False,
            "return_tokens": True}
    r = httpx.post(f"{url}/completion", json=body, timeout=900)  # a connection of its own (llama-server drops
    arrived = time.perf_counter()                                  # idle keep-alive ones: serve_servers.py)
    if r.status_code != 200:
        raise RuntimeError(f"llama-server /completion: HTTP {r.status_code}: {r.text[:300]}")
    return arrived, r.json()


def aggregate(answers: list[tuple[float, dict]]) -> tuple[float, int, list[list[int]], int, int]:
    """(decode seconds, tokens decoded in them, each request's output, drafted, accepted) of one batch's answers,
    the tuple bench/speculative.py's run() returns."""
    decoded, starts, ends, drafted, accepted = 0, [], [], 0, 0
    for arrived, answer in answers:
        t = answer["timings"]
        decoded += max(t["predicted_n"] - 1, 0)
        starts.append(arrived - t["predicted_ms"] / 1e3)
        ends.append(arrived)
        drafted += t.get("draft_n", 0)
        accepted += t.get("draft_n_accepted", 0)
    return max(ends) - min(starts), decoded, [a["tokens"] for _, a in answers], drafted, accepted


def run(mode: str, model: str, threads: int, streams: int, prompts: list[list[int]], max_tokens: int):
    """One batch on a llama-server started for it with `mode`'s speculation; run()'s tuple."""
    with llamacpp_server(model, threads, streams, MODES[mode]) as url:
        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(lambda p: complete(url, p, max_tokens), prompts))
    return aggregate(answers)
