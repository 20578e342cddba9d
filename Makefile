# streamtally's one task runner.  `make demo` and `make test` work on a fresh clone:
# they create .venv, install the project, and start the local stack as needed.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
ST := $(BIN)/streamtally

# The test tiers (tests/README.md), each run printing its slowest tests.  `make unit` runs the
# unit and agent tiers in TEST_WORKERS processes (pytest-xdist: 2, this 2-core machine's
# best on its own); the integration tier, heavy tests included, runs in INTEGRATION_WORKERS
# processes (--dist loadscope: a module per process, the longest first, tests/conftest.py
# SCOPE_ORDER; its tests mostly wait on the broker, workers, timeouts and outages, so four
# processes beat three here).  `make test` runs the lint, the type check and the unit and
# agent tiers beside the integration tier, not before it: they fill the cores the
# integration tier leaves idle while it waits.  There they run in pytest's own process
# (BESIDE_WORKERS=0): with the cores full, xdist's processes only add CPU (-n 1 took 61
# CPU-s for them, -n 0 50; tests/README.md has the figures).
TEST_WORKERS ?= 2
INTEGRATION_WORKERS ?= 4
BESIDE_WORKERS ?= 0
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
# pip resolves, in seconds rather than the better part of a minute.  It compiles their
# bytecode as it installs them (pip does by default, uv does not): where Python may not write
# bytecode itself (PYTHONDONTWRITEBYTECODE, as on this machine), every process would compile
# every module it imports again (a worker's imports: 1.4 CPU-s so, 0.6 with bytecode).
$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip uv

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/uv pip install --quiet --compile-bytecode --python $(BIN)/python -e '.[dev]'
	touch $@

install: $(VENV)/.installed

# The compiled hot path (streamtally/_native.py): built when missing or stale, skipped with a
# note where there is no C compiler (streamtally then runs as plain Python).  Then the
# project's own bytecode, for the same reason as the packages' (a second, about a second of
# CPU, and nothing where it is up to date).
SOURCES := streamtally processors producers topics tests benchmarks
setup: install
	@$(ST) native build --optional
	@$(BIN)/python -m compileall -q -j 0 $(SOURCES)

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

# The install and the compiled hot path's build first; then the lint, the type check and
# the unit and agent tiers in the background, beside the stack's start and the integration
# tier.  The integration tier's progress shows as it goes; the others' output is kept and
# shown after it.  All of them run, also after a failing one; the exit status says whether
# all passed.
test:
	@$(MAKE) --no-print-directory setup
	@log=$$(mktemp); trap 'rm -f "$$log"' EXIT; status=0; \
	echo "== lint, type check, unit and agent tiers beside the integration tier: their output follows its"; \
	$(MAKE) --no-print-directory --keep-going --jobs=3 --output-sync=target \
		TEST_WORKERS=$(BESIDE_WORKERS) lint typecheck test-unit > "$$log" 2>&1 & checks=$$!; \
	{ $(MAKE) --no-print-directory stack-up && \
		$(MAKE) --no-print-directory test-integration; } || status=1; \
	wait $$checks || status=1; \
	cat "$$log"; \
	exit $$status

# (make test's steps: a tier each, with no set-up of their own.)
test-unit:
	@echo "== unit and agent tiers (-n $(TEST_WORKERS))"
	$(UNIT_TIER)

test-integration:
	@echo "== integration tier, heavy tests included (-n $(INTEGRATION_WORKERS))"
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
