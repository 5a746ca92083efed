# Quick start: `make train`, then `make test`. Both set up .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Stamps: dpax and the stack it trains with; and what tests, lint and docs need.
CORE := $(VENV)/.installed
DEV := $(VENV)/.installed-dev
INTEROP := $(VENV)/.installed-interop

# Test files run in JOBS processes (pytest-xdist; one file's tests stay in one
# process, so they share its compiled steps).
JOBS ?= 2
PARALLEL := -n $(JOBS) --dist loadfile

.PHONY: setup setup-dev train test test-all test-slow test-processes test-fast test-tuned \
	test-interop \
	lint docs docs-site bench clean

setup: $(CORE)
setup-dev: $(DEV)

# Re-install only when the pins change; a no-op when already set up. No pip
# cache: it would keep a second copy of the wheels on the disk. `make train`
# needs the core set only; the dev set (pytest, the trackers, mkdocs, ...)
# comes with the first `make test`; torch and transformers (the interop extra,
# about 1 GB) only with `make test-interop`.
$(CORE): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check --no-cache-dir -e .
	touch $@

$(DEV): $(CORE)
	$(BIN)/pip install -q --disable-pip-version-check --no-cache-dir -e '.[dev]'
	touch $@

$(INTEROP): $(DEV)
	$(BIN)/pip install -q --disable-pip-version-check --no-cache-dir -e '.[dev,interop]'
	touch $@

train: $(CORE)
	$(BIN)/dpax train --out runs/digits-cnn --overwrite

lint: $(DEV)
	$(BIN)/ruff check src tests examples scripts

# The documentation site, built strictly: a broken link or a page missing
# from the nav fails the build.
docs-site: $(DEV)
	$(BIN)/mkdocs build --strict --quiet --site-dir $(or $(SITE),site)

# The tiers; CI (.ci/run) runs them all through `make test-all`. `make test`
# is lint, the docs' strict build and the main tier: the units and the
# equivalence proofs of each part of the promise, in pytest itself, on the
# default path, the one GPUs and TPUs take. `make test-slow` runs more of the
# same (other device counts, seeds, backends, models, optax transformations)
# and the long runs (the README's commands, exports, resumes past flipped
# bytes and from an older step); `make test-processes` the tests that start
# dpax processes (the installed entry point, multi-process launches, kill -9
# and resume, cluster restarts, trackers); `make test-interop` the comparisons
# with Hugging Face's own models (torch, transformers); `make test-tuned` the
# opt-in XLA:CPU tuning's own tests and the equivalence tests again with it on
# (dpax.parallel.platform). `make test-all` shares one session directory
# (tests/conftest.py) among them, so its persistent XLA cache too.
MAIN := not slow and not processes and not tuned and not interop

test: lint
	site=$$(mktemp -d) && $(MAKE) docs-site SITE=$$site && rm -rf $$site
	DPAX_XLA_CPU_TUNING=0 $(BIN)/pytest $(PARALLEL) -m "$(MAIN)" --durations=15

test-slow: $(DEV)
	DPAX_XLA_CPU_TUNING=0 $(BIN)/pytest $(PARALLEL) -m "slow and not processes and not tuned and not interop" \
	  --durations=10

test-processes: $(DEV)
	DPAX_XLA_CPU_TUNING=0 $(BIN)/pytest $(PARALLEL) -m "processes and not interop" --durations=5

test-interop: $(INTEROP)
	DPAX_XLA_CPU_TUNING=0 $(BIN)/pytest $(PARALLEL) -m interop --durations=5

test-tuned: $(DEV)
	DPAX_XLA_CPU_TUNING=1 $(BIN)/pytest $(PARALLEL) -m "(tuned or equivalence) and not interop"

test-all:
	session=$$(mktemp -d) && trap 'rm -rf "$$session"' EXIT && \
	  export DPAX_TEST_SESSION_DIR=$$session && \
	  $(MAKE) test && $(MAKE) test-slow && $(MAKE) test-processes && $(MAKE) test-interop && \
	  $(MAKE) test-tuned

# The main tier without the tests marked `equivalence` (test_equivalence.py
# and the N-vs-1 runs test-tuned repeats): a quicker first look.
test-fast: lint
	DPAX_XLA_CPU_TUNING=0 $(BIN)/pytest $(PARALLEL) -m "$(MAIN) and not equivalence"

# The flag table in docs/cli.md is generated from TrainConfig; a test checks it is current.
docs: $(DEV)
	$(BIN)/python scripts/update_flag_table.py

# About 15 minutes here; rewrites benchmarks/results/.
bench: $(CORE)
	$(BIN)/dpax bench --repeats 7 --out benchmarks/results

clean:
	rm -rf $(VENV) runs site .pytest_cache .ruff_cache
