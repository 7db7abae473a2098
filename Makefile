# gpuwarden: `make demo` and `make test` work on a fresh machine with only python3 and make.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test lint typecheck unit bench soak clean standin-table setup

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]' --config-settings editable_mode=strict
	touch $(STAMP)

# Strict editable installs expose only the files present at install time: refresh them (fast).
$(VENV)/.refreshed: $(STAMP) $(wildcard daemon/*.py api/*.py standin/*.py standin/data/*.json)
	$(BIN)/python -m pip install -q --no-deps -e . --config-settings editable_mode=strict
	touch $@

setup: $(VENV)/.refreshed

demo: setup
	$(BIN)/gpuwarden demo

lint: setup
	$(BIN)/ruff check daemon api standin tests bench
	$(BIN)/ruff format --check daemon api standin tests bench

typecheck: setup
	$(BIN)/mypy -p gpuwarden.daemon -p gpuwarden.api -p gpuwarden.standin

unit: setup
	$(BIN)/pytest -q -p no:cacheprovider

test: lint typecheck unit

# Regenerates the stand-in's 0.5.23 option table from SGLang's own --help.
standin-table: setup
	$(BIN)/python -m gpuwarden.standin.table ../shared/fixtures/sglang-0.5.23-help.txt standin/data/options-0.5.23.json

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache .pytest_cache

# Benchmarks print figures; they are not part of `make test`.
bench: setup
	mkdir -p bench/results
	$(BIN)/python bench/core.py --json bench/results/core.json | tee bench/results/core.md
	$(BIN)/python bench/api.py | tee bench/results/api.md

# A bounded soak: 1,000 crash -> restart cycles with zero backoff; prints flat-or-not figures.
soak: setup
	$(BIN)/python bench/soak.py --cycles 1000
