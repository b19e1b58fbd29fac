# Developer entry points. Every target that runs code first makes sure .venv is set up.
# `make setup` is idempotent: it creates .venv when missing and (re)installs only when a
# requirements file or pyproject.toml changed since the last install (stamp file in .venv).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.dartree-setup-stamp
PROMPT ?= Write a haiku about speculative decoding.
ARGS ?=

.PHONY: setup test serve generate bench-tree

setup: $(STAMP)

$(STAMP): requirements.txt requirements-dev.txt requirements-data.txt pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -r requirements-dev.txt
	$(PIP) install --no-deps -r requirements-data.txt
	$(PIP) install --no-deps -e .
	@touch $@

test: setup
	$(BIN)/python -m pytest -q -m "not slow" $(ARGS)

serve: setup
	$(BIN)/dartree serve $(ARGS)

generate: setup
	$(BIN)/dartree generate "$(PROMPT)" $(ARGS)

bench-tree: setup
	$(BIN)/python -m benchmarks.bench_tree $(ARGS)
