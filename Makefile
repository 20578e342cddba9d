# streamtally's one task runner.  `make demo` and `make test` work on a fresh clone:
# they create .venv, install the project, and start the local stack as needed.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
ST := $(BIN)/streamtally

# The test tiers (tests/README.md), each printing its slowest tests: the unit and agent tiers
# in parallel (pytest-xdist, TEST_WORKERS processes: 2, this 2-core machine's best), then the
# integration tier on the stack, then the heavy tier alone (its tests stop, pause or restart
# the stack's services, or start stacks of their own: nothing may run beside them).
TEST_WORKERS ?= 2
PYTEST := $(BIN)/pytest -q --durations=15
UNIT_TIER := $(PYTEST) -n $(TEST_WORKERS) tests/unit tests/agents
INTEGRATION_TIER := $(PYTEST) tests/integration -m "not heavy"
HEAVY_TIER := $(PYTEST) tests/integration/heavy

.PHONY: help setup demo test check lint typecheck unit integration heavy bench stack-up stack-down clean

help:
	@echo "make demo        set up, start Kafka + Redis + registry, run the pipeline on the samples"
	@echo "make test        set up, lint, type-check, run every test tier (starts the stack)"
	@echo "make unit / integration / heavy   one tier (tests/README.md)"
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
	$(UNIT_TIER)

integration: setup stack-up
	$(INTEGRATION_TIER)

heavy: setup stack-up
	$(HEAVY_TIER)

check: lint typecheck unit

# Every tier runs, also after a failing one; the exit status says whether all passed.
test: setup lint typecheck stack-up
	@status=0; \
	echo "== unit and agent tiers ($(TEST_WORKERS) processes)"; $(UNIT_TIER) || status=1; \
	echo "== integration tier"; $(INTEGRATION_TIER) || status=1; \
	echo "== heavy tier"; $(HEAVY_TIER) || status=1; \
	exit $$status

bench: setup stack-up
	$(ST) bench fold
	$(ST) bench pipeline

stack-up: setup
	$(ST) stack up

stack-down: setup
	$(ST) stack down

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
