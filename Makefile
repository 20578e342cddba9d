# streamtally's one task runner.  `make demo` and `make test` work on a fresh clone:
# they create .venv, install the project, and start the local stack as needed.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
ST := $(BIN)/streamtally

# The test tiers (tests/README.md).  `make test` runs them all in one parallel run
# (pytest-xdist, INTEGRATION_WORKERS processes, --dist loadscope: a module per process, the
# longest first: the heavy tests, the integration tier, then the agent and unit tiers fill
# the end; tests/conftest.py SCOPE_ORDER), beside the lint and the type check.  Integration
# tests mostly wait on the broker, workers, timeouts and outages, so three processes beat two
# on this 2-core machine.  `make unit` runs the unit and agent tiers alone (TEST_WORKERS
# processes: 2, this machine's best for them), `make integration` the integration tier.
TEST_WORKERS ?= 2
INTEGRATION_WORKERS ?= 3
PYTEST := $(BIN)/pytest -q --durations=15
PARALLEL := $(PYTEST) -n $(INTEGRATION_WORKERS) --dist loadscope
UNIT_TIER := $(PYTEST) -n $(TEST_WORKERS) tests/unit tests/agents
INTEGRATION_TIER := $(PARALLEL) tests/integration
ALL_TIERS := $(PARALLEL) tests/unit tests/agents tests/integration

# The stacks a test run starts (the shared one, and those of the heavy tests) start often and
# carry little: their Kafka runs lean (docs/operations.md), at about half the CPU.
test test-tiers integration heavy: export STREAMTALLY_KAFKA_JVM_OPTS ?= lean

.PHONY: help install setup demo test test-tiers check lint typecheck unit integration heavy bench stack-up stack-down clean

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

# First the steps the tests need, at once: the install and the compiled hot path's build
# beside the stack's start; then every tier beside the lint and the type check (each line
# of output as it comes).  All of them run, also after a failing one; the exit status says
# whether all passed.
test:
	@$(MAKE) --no-print-directory --jobs=2 --output-sync=target setup stack-up
	@$(MAKE) --no-print-directory --keep-going --jobs=3 --output-sync=line lint typecheck test-tiers

# (make test's: the tiers, once the set-up and the stack are there.)
test-tiers:
	@echo "== every tier, in one run of $(INTEGRATION_WORKERS) processes"
	$(ALL_TIERS)

bench: setup stack-up
	$(ST) bench fold
	$(ST) bench pipeline

stack-up: install
	$(ST) stack up

stack-down: install
	$(ST) stack down

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
