"""schemathesis over the server's own OpenAPI document (GET /openapi.json) against a real Serve app.

Positive and negative cases for every operation (the completions and chat request models, /v1/models, /health),
with these checks: never 5xx; status codes, content types, headers and bodies as the document says; data the
document excludes refused with 4xx; a method a path does not have answered 405 with Allow; and every 4xx of a
request body is OpenAI's error object naming a field. Not checked: that every request the document allows is
accepted (openapi_doc.py lists the rules across fields and of token counts it cannot express).
"""

from __future__ import annotations

from collections import Counter

import httpx
import pytest
import schemathesis
import schemathesis.engine
from schemathesis.config import SchemathesisConfig
from schemathesis.engine import events

from fuzz_values import SCALE

pytestmark = pytest.mark.slow


CHECKED = Counter()  # responses openai_error looked at: the test fails if schemathesis never ran it


@schemathesis.check
def openai_error(ctx, response, case) -> None:
    """A 4xx names what is wrong in OpenAI's shape; a refused body names a field (param)."""
    if 400 <= response.status_code < 500 and case.operation.path != "/health":
        CHECKED[response.status_code] += 1
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["type"], error
        if case.method == "POST" and response.status_code in (400, 413):
            assert error["param"] is not None, error


def run_schemathesis(http_url: str) -> tuple[list[str], dict[str, int]]:
    """schemathesis' own engine (what its CLI runs: examples, coverage and fuzzing phases) on the served document;
    returns the failures it reports and the count of each response status. (Its pytest plugin's lazy loader does
    not work under pytest 9.2: it sets the removed Function._nodeid.)"""
    config = SchemathesisConfig.from_dict({
        "base-url": http_url,
        # the coverage phase (boundary values of every field, every other method: ~1000 requests, 85 s on 2 busy
        # cores) runs in the long form only
        "phases": {"stateful": {"enabled": False}, "coverage": {"enabled": SCALE > 1}},
        "generation": {"mode": "all", "deterministic": SCALE == 1, "max-examples": 40 * SCALE},
        "checks": {"positive_data_acceptance": {"enabled": False},
                   "negative_data_rejection": {"expected-statuses": [400, 404, 405, 413]}},
        "request-timeout": 120,
    })
    schema = schemathesis.openapi.from_url(f"{http_url}/openapi.json", config=config)
    failures, statuses = [], Counter()
    for event in schemathesis.engine.from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished):
            for interaction in event.recorder.interactions.values():
                if interaction.response is not None:
                    statuses[f"{interaction.request.method} {interaction.response.status_code}"] += 1
            for case_id, checks in event.recorder.checks.items():
                case = event.recorder.cases[case_id].value
                failures += [f"{case.method} {case.path} {case.body!r:.300}: {c.name}: {c.failure_info.failure.title}: "
                             f"{c.failure_info.failure.message:.500}" for c in checks if c.failure_info is not None]
        elif isinstance(event, (events.NonFatalError, events.FatalError)):
            failures.append(f"schemathesis error: {event!r:.1000}")
    return failures, dict(statuses)


def test_openapi(http_url):
    failures, statuses = run_schemathesis(http_url)
    print(statuses)
    assert not failures, "\n".join(failures[:20])
    assert sum(n for k, n in statuses.items() if k.startswith("POST 2")) > 0, statuses  # some got to the engine
    assert sum(n for k, n in statuses.items() if k.startswith("POST 4")) > 0, statuses
    assert CHECKED[400] > 0, CHECKED


def test_document_served_and_valid_request_after(http_url):
    doc = httpx.get(f"{http_url}/openapi.json", timeout=30).json()
    assert set(doc["paths"]) == {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"}
    r = httpx.post(f"{http_url}/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "temperature": 0},
                   timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
