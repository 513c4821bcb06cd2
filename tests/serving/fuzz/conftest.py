"""One Serve app for all fuzz tests (HTTP, schemathesis, gRPC): real Ray Serve on 127.0.0.1, real SmolLM2.

A short context keeps every accepted request cheap (at most ~38 new tokens whatever max_tokens says; a chat prompt
takes 31 of the 40) and makes "prompt past the context" easy to reach; a small body limit makes "oversized"
reachable too.
"""

from __future__ import annotations

import pytest

from tests.serving.conftest import BASE_CONFIG, run_app  # loaded by pytest before this one

FUZZ_CONFIG = dict(max_model_len=40, max_request_bytes=65536)


@pytest.fixture(scope="package")
def serving():
    yield from run_app({**BASE_CONFIG, **FUZZ_CONFIG})
