# streamtally's one task runner.  `make demo` and `make test` work on a fresh clone:
# they create .venv, install the project, and start the local stack as needed.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
ST := $(BIN)/streamtally

# The test tiers (tests/README.md), each run printing its slowest tests: the unit and agent
# tiers in parallel (pytest-xdist, TEST_WORKERS processes: 2, this 2-core machine's best),
# then the integration tier, heavy tests included, in INTEGRATION_WORKERS processes
# (--dist loadscope: a module per process, the longest first, tests/conftest.py
# SCOPE_ORDER; its tests mostly wait on the broker, workers, timeouts and outages, so three
# processes beat two here; four took 288 s against 324, but the scale-out test's rebalance
# checks failed in one of two runs of four: tests/README.md).
TEST_WORKERS ?= 2
INTEGRATION_WORKERS ?= 3
PYTEST := $(BIN)/pytest -q --durations=15
PARALLEL := $(PYTEST) -n $(INTEGRATION_WORKERS) --dist loadscope
UNIT_TIER := $(PYTEST) -n $(TEST_WORKERS) tests/unit tests/agents
INTEGRATION_TIER := $(PARALLEL) tests/integration

# The stacks a test run starts (the shared one, and those of the heavy tests) start often and
# carry little: their Kafka runs lean (docs/operations.md), at about half the CPU.
test test-integration integration heavy: export STREAMTALLY_KAFKA_JVM_OPTS ?= lean

.PHONY: help install setup demo test test-unit test-integration check lint typecheck unit integration heavy bench stack-up stack-down clean

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
	$(PARALLEL) tests/integration/heavy

check: lint typecheck unit

# The install and the compiled hot path's build first; then at once the lint, the type
# check, the stack's start and the unit and agent tiers (each one's output together); then
# the integration tier (measured: 399 s in all; with the lint and the type check beside
# the integration tier instead, 447 s).  All of them run, also after a failing one; the
# exit status says whether all passed.
test:
	@$(MAKE) --no-print-directory setup
	@status=0; \
	$(MAKE) --no-print-directory --keep-going --jobs=4 --output-sync=target \
		lint typecheck stack-up test-unit || status=1; \
	$(MAKE) --no-print-directory test-integration || status=1; \
	exit $$status

# (make test's steps: a tier each, with no set-up of their own.)
test-unit:
	@echo "== unit and agent tiers ($(TEST_WORKERS) processes)"
	$(UNIT_TIER)

test-integration:
	@echo "== integration tier, heavy tests included ($(INTEGRATION_WORKERS) processes)"
	$(INTEGRATION_TIER)

bench: setup stack-up
	$(ST) bench fold
	$(ST) bench pipeline

stack-up: install
	$(ST) stack up

stack-down: install
	$(ST) stack down

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
