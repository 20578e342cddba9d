# streamtally's one task runner.  `make demo` and `make test` work on a fresh clone:
# they create .venv, install the project, and start the local stack as needed.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
ST := $(BIN)/streamtally

# The test tiers (tests/README.md), each printing its slowest tests: the unit and agent tiers
# in parallel (pytest-xdist, TEST_WORKERS processes: 2, this 2-core machine's best), then the
# integration tier, heavy tests included, in INTEGRATION_WORKERS processes (a module per
# process; its tests mostly wait on the broker, workers, timeouts and outages, so three beat
# two here; the heavy ones run on stacks of their own or on a fault stack).
TEST_WORKERS ?= 2
INTEGRATION_WORKERS ?= 3
PYTEST := $(BIN)/pytest -q --durations=15
UNIT_TIER := $(PYTEST) -n $(TEST_WORKERS) tests/unit tests/agents
INTEGRATION_TIER := $(PYTEST) -n $(INTEGRATION_WORKERS) --dist loadscope tests/integration

# The stacks a test run starts (the shared one, and those of the heavy tests) start often and
# carry little: their Kafka runs lean (docs/operations.md), at about half the CPU.
test integration heavy: export STREAMTALLY_KAFKA_JVM_OPTS ?= lean

.PHONY: help install setup demo test check lint typecheck unit integration heavy bench stack-up stack-down clean

help:
	@echo "make demo        set up, start Kafka + Redis + registry, run the pipeline on the samples"
	@echo "make test        set up, lint, type-check, run every test tier (starts the stack)"
	@echo "make unit / integration / heavy   one tier (tests/README.md)"
	@echo "make bench       fold and pipeline benchmarks (figures, not pass/fail)"
	@echo "make stack-up / stack-down   the local Kafka + Redis"

# uv (from PyPI, into the venv) installs the project and its dev extras: the same packages
# pip resolves, in seconds rather than the better part of a minute.
$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip uv

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/uv pip install --quiet --python $(BIN)/python -e '.[dev]'
	touch $@

install: $(VENV)/.installed

# The compiled hot path (streamtally/_native.py): built when missing or stale, skipped with a
# note where there is no C compiler (streamtally then runs as plain Python).
setup: install
	@$(ST) native build --optional

demo: setup
	$(ST) demo

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

typecheck: install
	$(BIN)/mypy

unit: setup
	$(UNIT_TIER)

integration: setup stack-up
	$(INTEGRATION_TIER) -m "not heavy"

heavy: setup stack-up
	$(PYTEST) -n $(INTEGRATION_WORKERS) --dist loadscope tests/integration/heavy

check: lint typecheck unit

# Every tier runs, also after a failing one; the exit status says whether all passed.
# The set-up steps that do not depend on each other run at once: the compiled hot path's
# build beside the lint, the type check and the stack's start (each step's output together).
test:
	@$(MAKE) --no-print-directory --jobs=3 --output-sync=target setup lint typecheck stack-up
	@status=0; \
	echo "== unit and agent tiers ($(TEST_WORKERS) processes)"; $(UNIT_TIER) || status=1; \
	echo "== integration tier, heavy tests included ($(INTEGRATION_WORKERS) processes)"; \
	$(INTEGRATION_TIER) || status=1; \
	exit $$status

bench: setup stack-up
	$(ST) bench fold
	$(ST) bench pipeline

stack-up: install
	$(ST) stack up

stack-down: install
	$(ST) stack down

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
