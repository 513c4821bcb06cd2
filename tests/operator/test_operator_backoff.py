"""Backoff after refused child writes, and the API's Status reason/message carried by KubeError."""
from __future__ import annotations

import json

import pytest

from cpuserve.operator.backoff import Backoff
from cpuserve.operator.kube import KubeError


@pytest.mark.parametrize("refusals,delay", [(1, 5.0), (2, 10.0), (3, 20.0), (6, 160.0), (7, 300.0), (200, 300.0)])
def test_delay_doubles_then_caps(refusals, delay):
    assert Backoff(5.0, 300.0).delay(refusals) == delay


def test_one_window_per_service_until_a_pass_succeeds():
    b = Backoff(1.0, 8.0)
    assert b.remaining("ns/a", 100.0) == 0.0
    assert b.refused("ns/a", 100.0) == 1.0 and b.remaining("ns/a", 100.25) == 0.75
    assert b.remaining("ns/b", 100.25) == 0.0, "another LLMService is not held back"
    assert b.refused("ns/a", 101.0) == 2.0 and b.remaining("ns/a", 103.5) == 0.0
    b.succeeded("ns/a")
    assert b.refused("ns/a", 200.0) == 1.0, "the count restarts after a successful pass"


def test_a_new_generation_runs_at_once_and_counts_again():
    b = Backoff(1.0, 8.0)
    for now in (0.0, 1.0, 3.0):
        b.refused("ns/a", now, generation=4)
    assert b.remaining("ns/a", 3.5, generation=4) == 3.5  # 4 s after the third refusal
    assert b.remaining("ns/a", 3.5, generation=5) == 0.0, "a spec change may be the fix: no wait"
    assert b.refused("ns/a", 3.5, generation=5) == 1.0


STATUS_403 = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "reason": "Forbidden",
              "message": 'pods "x" is forbidden: error looking up service account ns/default', "code": 403}


@pytest.mark.parametrize("body,reason,message", [
    (json.dumps(STATUS_403).encode(), "Forbidden", STATUS_403["message"]),
    (b"<html>bad gateway</html>", "HTTP502", "<html>bad gateway</html>"),
    (None, "HTTP502", "Bad Gateway"),
])
def test_kube_error_takes_the_status_reason_and_message(body, reason, message):
    err = KubeError.from_response(502 if reason == "HTTP502" else 403, body, "Bad Gateway")
    assert (err.reason, err.message) == (reason, message)
