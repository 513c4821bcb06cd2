"""Hypothesis against the HTTP API of a real Serve app: raw bodies and both request models with fields set to
anything (wrong types, huge numbers, deep nesting, lone surrogates, oversized text, huge max_tokens, prompts past
the context). Every answer is 2xx with a whole response, or 4xx with OpenAI's error object whose `param` names a
field the request got wrong; never 5xx; and a valid request succeeds after each batch."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from cpuserve.serving.openai_api import IGNORED_FIELDS, ChatRequest, CompletionRequest
from fuzz_values import LONG_TEXT, NASTY, TEXT, fuzz_settings, json_values, raw_bodies

pytestmark = pytest.mark.slow

VALID = {"completions": {"prompt": "Hello", "max_tokens": 2, "temperature": 0},
         "chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}}
FIELDS = {"completions": sorted(set(CompletionRequest.model_fields) | IGNORED_FIELDS),
          "chat/completions": sorted(set(ChatRequest.model_fields) | IGNORED_FIELDS)}
UNKNOWN = ["suffix", "best_of", "functions", "frobnicate", "", "Prompt", "max tokens"]
# values that reach deeper into the models than NASTY alone: prompts and messages of the right outer shape
SHAPED = {
    "prompt": LONG_TEXT | st.lists(st.integers(-5, 2**40) | st.integers(0, 49_151), max_size=80),
    "messages": st.lists(st.fixed_dictionaries({"role": TEXT, "content": TEXT | LONG_TEXT | json_values()},
                                               optional={"tool_calls": json_values(), "name": TEXT}), max_size=3),
    "max_tokens": st.integers(1, 2**70), "stop": st.lists(TEXT, max_size=3), "logit_bias": st.dictionaries(
        TEXT | st.integers(0, 60_000).map(str) | st.sampled_from(["\u00b2", "\u0663", "\uff11", "1 ", "+1"]),
        json_values(2), max_size=3),
}


def post(http_url: str, path: str, content: bytes) -> httpx.Response:
    return httpx.post(f"{http_url}/v1/{path}", content=content, headers={"content-type": "application/json"},
                      timeout=120)


def check_answer(r: httpx.Response, named: set[str] | None) -> None:
    """2xx: a whole completion or a stream ending in [DONE]; 4xx: OpenAI's error naming one of `named` (any field
    when None, "body" for the body as a whole)."""
    assert r.status_code < 500, r.text[:2000]
    event(f"HTTP {r.status_code}")  # --hypothesis-show-statistics: how many got through to the engine
    if r.status_code < 300:
        if r.headers["content-type"].startswith("text/event-stream"):
            events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]", r.text[-2000:]
            assert all("error" not in json.loads(e) for e in events[:-1])
        else:
            assert r.json()["choices"], r.text
        return
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["type"], error
    assert error["param"] is not None, error  # every refusal of a body names what is wrong ("" is a field too)
    param = error["param"]
    assert named is None or any(param == k or param.startswith(f"{k}.") for k in named | {"body"}), (error, named)
    if param == "body":
        assert r.status_code in (400, 413), error


def assert_still_serves(http_url: str) -> None:
    for path, body in VALID.items():
        r = httpx.post(f"{http_url}/v1/{path}", json=body, timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


@pytest.mark.parametrize("path", list(VALID))
def test_raw_bodies(http_url, path):
    @fuzz_settings(40)
    @given(body=raw_bodies(VALID[path]))
    def run(body: bytes) -> None:
        r = post(http_url, path, body)
        try:
            data = json.loads(body)
        except (ValueError, RecursionError):
            data = None
        # the field named: one the body has, or a required one it lacks (prompt / messages), or the body itself
        named = set(data) | {"prompt", "messages"} if isinstance(data, dict) else set()
        check_answer(r, named)

    run()
    assert_still_serves(http_url)


@pytest.mark.parametrize("path", list(VALID))
def test_fields(http_url, path):
    """A valid request with one to three fields set to anything: an error names one of them."""
    names = st.sampled_from(FIELDS[path] + UNKNOWN)

    @fuzz_settings(60)
    @given(data=st.data())
    def run(data) -> None:
        changed = data.draw(st.dictionaries(names, st.none(), min_size=1, max_size=3))
        for name in changed:
            changed[name] = data.draw(SHAPED[name] | NASTY if name in SHAPED else NASTY, label=name)
        body = json.dumps({**VALID[path], **changed}).encode()
        check_answer(post(http_url, path, body), set(changed))

    run()
    assert_still_serves(http_url)
