"""The ingress sends to LLMServer over the data plane of its own process's environment, not the one of the process
that built the app: a handle carries its options, and a driver that imported Ray Serve before RAY_ENV was set made
every handle a by-reference one (a Ray actor task per request, an object reference per token message)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# a handle made the way a driver without RAY_ENV makes it (by reference), then given to own_data_plane in a
# process with the environment under test; prints whether the result still goes by reference
PROBE = """
from ray.serve.handle import DeploymentHandle
from cpuserve.serving.ray_env import own_data_plane
from ray.serve._private.handle_options import DynamicHandleOptions
made_elsewhere = DeploymentHandle("LLMServer", "cpuserve", handle_options=DynamicHandleOptions(_by_reference=True))
print(own_data_plane(made_elsewhere).handle_options._by_reference)
"""


@pytest.mark.parametrize("use_grpc, by_reference", [("1", "False"), ("0", "True")])
def test_ingress_handle_follows_its_own_process_environment(use_grpc, by_reference):
    env = {**os.environ, "RAY_SERVE_USE_GRPC_BY_DEFAULT": use_grpc}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == by_reference


def test_start_serving_sets_ray_env_before_importing_ray_serve():
    """The driver reads Serve's constants when it first imports Ray Serve: start_serving sets RAY_ENV before that.
    The config is refused before Ray starts (more ranks than the model's KV heads), after the imports."""
    probe = ("from cpuserve.serving.app import start_serving\n"
             "from cpuserve.serving.config import ServeConfig\n"
             "try:\n"
             "    start_serving(ServeConfig(ranks_per_replica=64))\n"
             "except ValueError as e:\n"
             "    assert 'ranks_per_replica' in str(e), e\n"
             "import ray\n"
             "import ray.serve._private.constants as serve_constants\n"
             "print(ray.is_initialized(), serve_constants.RAY_SERVE_USE_GRPC_BY_DEFAULT)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_SERVE")}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False True"
