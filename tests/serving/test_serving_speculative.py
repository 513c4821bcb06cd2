"""Speculative decoding served: acceptance in the usage of the OpenAI API (the official client) and of gRPC, and the
drafted / accepted counters on the Prometheus endpoint. One replica, real SmolLM2, speculative="ngram"."""

from __future__ import annotations

import time

import pytest

from cpuserve.v1 import inference_pb2 as pb

pytestmark = pytest.mark.slow

SERVE_CONFIG = dict(speculative="ngram")
M = 'model="SmolLM2-135M-Instruct"'
CODE = '''def area(width, height):
    result = width * height
    return result
'''
COPY = [{"role": "user", "content": f"Repeat this code exactly:\n{CODE}"}]


@pytest.fixture(scope="module")
def client(http_url):
    from openai import OpenAI

    return OpenAI(base_url=f"{http_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_usage_reports_drafted_and_accepted_tokens_and_prometheus_counts_them(client, grpc_stub, scrape):
    before = scrape()
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=COPY, max_tokens=48, temperature=0)
    details = r.usage.completion_tokens_details
    accepted, rejected = details.accepted_prediction_tokens, details.rejected_prediction_tokens
    assert 0 < accepted < r.usage.completion_tokens and rejected >= 0
    g = grpc_stub.Complete(pb.GenerateRequest(text="Repeat: one two three four, one two three four, one two three",
                                              sampling=pb.SamplingParameters(max_tokens=24, temperature=0)))
    assert g.usage.draft_tokens >= g.usage.accepted_draft_tokens > 0
    assert g.usage.accepted_draft_tokens < g.usage.completion_tokens  # a step's first token is never a draft
    one = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=COPY, max_tokens=1, temperature=0)
    assert one.usage.completion_tokens_details is None  # a first token is never drafted: no details
    want_drafted = accepted + rejected + g.usage.draft_tokens
    want_accepted = accepted + g.usage.accepted_draft_tokens
    deadline = time.monotonic() + 30
    while True:  # replicas report their totals every stats_interval_s
        after = scrape()
        got = [after[f"cpuserve_spec_{n}_tokens_total{{{M}}}"] - before.get(f"cpuserve_spec_{n}_tokens_total{{{M}}}", 0)
               for n in ("draft", "accepted")]
        if got == [want_drafted, want_accepted] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert got == [want_drafted, want_accepted]
