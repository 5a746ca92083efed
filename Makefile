# Quick start: `make train`, then `make test`. Both set up .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup train test test-fast lint docs bench clean

setup: $(STAMP)

# Re-install only when the pins change; a no-op when already set up.
$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

train: $(STAMP)
	$(BIN)/dpax train --out runs/digits-cnn --overwrite

lint: $(STAMP)
	$(BIN)/ruff check src tests examples scripts

test: lint
	$(BIN)/pytest

# The unit tier: no test marked slow (those start dpax processes or train long).
test-fast: lint
	$(BIN)/pytest -m "not slow"

# The README's flag table is generated from TrainConfig; a test checks it is current.
docs: $(STAMP)
	$(BIN)/python scripts/update_readme_flags.py

# About 15 minutes here; rewrites benchmarks/results/.
bench: $(STAMP)
	$(BIN)/dpax bench --repeats 7 --out benchmarks/results

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
