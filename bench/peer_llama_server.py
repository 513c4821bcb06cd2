"""llama.cpp's own `llama-server`, built once from the llama.cpp vendored in the pinned llama-cpp-python sdist.

The wheel of llama-cpp-python carries the library only; its `llama_cpp.server` is a Python server that decodes one
request at a time. The C++ `llama-server` batches its slots continuously (`-np N`), which is the fair peer for a
serving benchmark. Its build lives in <root>/llama-server (root as bench/peer_envs.py's, one level up):

    <root>/llama-server/llama_cpp_python-<version>.tar.gz   the sdist pip downloaded
    <root>/llama-server/build/bin/llama-server             the binary (only this target is built)
    <root>/llama-server/build.log                          cmake's output of the last build

    python bench/peer_llama_server.py      # download + build (~10 minutes on 2 cores the first time), then a no-op
"""
from __future__ import annotations

import fcntl
import glob
import os
import subprocess
import sys
import tarfile
import tomllib

import peer_envs


def folder() -> str:
    return os.path.join(os.path.dirname(peer_envs.root()), "llama-server")


def binary() -> str:
    return os.path.join(folder(), "build", "bin", "llama-server")


def version() -> str:
    """The llama-cpp-python pyproject's bench extra pins, so both llama.cpp peers build from one source."""
    with open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]["bench"]
    pin = next(d for d in extras if d.startswith("llama-cpp-python"))
    return pin.split("==")[1]


def build() -> str:
    """Download the sdist, build `llama-server` alone (native CPU flags, no UI download, no TLS), once; returns
    its path. Raises RuntimeError naming the step and the log on failure."""
    os.makedirs(folder(), exist_ok=True)
    with open(os.path.join(folder(), ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second caller waits for the first one's build
        return binary() if os.access(binary(), os.X_OK) else _build()


def _build() -> str:
    log_path = os.path.join(folder(), "build.log")
    sdist = f"llama_cpp_python-{version()}"
    source = os.path.join(folder(), sdist, "vendor", "llama.cpp")
    with open(log_path, "w") as log:
        def run(cmd: list[str], step: str) -> None:
            print(f"[llama-server] {step} ...", file=sys.stderr, flush=True)
            if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=folder()).returncode:
                raise RuntimeError(f"llama-server {step} failed: see {log_path}")

        if not os.path.isdir(source):
            if not glob.glob(os.path.join(folder(), f"{sdist}.tar.gz")):
                run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                     f"llama-cpp-python=={version()}", "-d", folder()], "download of the sdist")
            with tarfile.open(os.path.join(folder(), f"{sdist}.tar.gz")) as tar:
                tar.extractall(folder(), filter="data")
        build_dir = os.path.join(folder(), "build")
        run(["cmake", "-S", source, "-B", build_dir, "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
             "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
             "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_OPENSSL=OFF"], "configure")
        run(["cmake", "--build", build_dir, "--target", "llama-server", "-j", str(len(os.sched_getaffinity(0)))],
            "build")
    return binary()


if __name__ == "__main__":
    print(build())
