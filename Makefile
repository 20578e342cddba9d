# streamtally's one task runner.  `make demo` and `make test` work on a fresh clone:
# they create .venv, install the project, and start the local stack as needed.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
ST := $(BIN)/streamtally

.PHONY: help setup demo test check lint typecheck unit integration bench stack-up stack-down clean

help:
	@echo "make demo        set up, start Kafka + Redis + registry, run the pipeline on the samples"
	@echo "make test        set up, lint, type-check, run every test tier (starts the stack)"
	@echo "make bench       fold and pipeline benchmarks (figures, not pass/fail)"
	@echo "make stack-up / stack-down   the local Kafka + Redis"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

# The compiled hot path (streamtally/_native.py): built when missing or stale, skipped with a
# note where there is no C compiler (streamtally then runs as plain Python).
setup: $(VENV)/.installed
	@$(ST) native build --optional

demo: setup
	$(ST) demo

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

typecheck: setup
	$(BIN)/mypy

unit: setup
	$(BIN)/pytest -m "not integration" -q

integration: setup stack-up
	$(BIN)/pytest -m integration -q

check: lint typecheck unit

test: setup lint typecheck stack-up
	$(BIN)/pytest -q

bench: setup stack-up
	$(ST) bench fold
	$(ST) bench pipeline

stack-up: setup
	$(ST) stack up

stack-down: setup
	$(ST) stack down

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
