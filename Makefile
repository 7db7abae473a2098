# gpuwarden: `make demo` and `make test` work on a fresh machine with only python3 and make.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test test-real bench-real lint typecheck unit bench bench-repeat bench-shim soak clean standin-table setup

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]' --config-settings editable_mode=strict
	touch $(STAMP)

# Strict editable installs expose only the files present at install time: refresh them (fast).
$(VENV)/.refreshed: $(STAMP) $(wildcard daemon/*.py daemon/server/*.py daemon/proxy/*.py api/*.py api/ui/* standin/*.py standin/data/*.json)
	$(BIN)/python -m pip install -q --no-deps -e . --config-settings editable_mode=strict
	touch $@

setup: $(VENV)/.refreshed

demo: setup
	$(BIN)/gpuwarden demo

lint: setup
	$(BIN)/ruff check daemon api standin tests bench
	$(BIN)/ruff format --check daemon api standin tests bench
	$(BIN)/lint-imports

typecheck: setup
	$(BIN)/mypy -p gpuwarden.daemon -p gpuwarden.api -p gpuwarden.standin
	$(BIN)/mypy tests/support/effects.py  # the machine tests' recording Effects is the protocol

unit: setup
	$(BIN)/pytest -q -p no:cacheprovider -n 2 --ignore=tests/real

test: lint typecheck unit

# The real SGLang 0.5.23 on the CPU, serving a tiny model made here. Its environment (torch
# 2.13.0's CPU wheel, SGLang and its CPU dependencies, the model) is built once into
# ${XDG_CACHE_HOME:-~/.cache}/gpuwarden/test-real/<hash> (GPUWARDEN_TEST_REAL_CACHE moves it).
test-real: setup
	$(PYTHON) tests/real/env.py
	$(BIN)/pytest -q -p no:cacheprovider tests/real

# Regenerates the stand-in's 0.5.23 option table from SGLang's own --help.
standin-table: setup
	$(BIN)/python -m gpuwarden.standin.table tests/fixtures/sglang-0.5.23-help.txt standin/data/options-0.5.23.json

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache .pytest_cache .import_linter_cache

# Benchmarks print figures; they are not part of `make test`. The peers (supervisord from PyPI,
# PM2 from npm with this machine's node) are installed into bench/.peers, apart from the project.
PEERS := bench/.peers
$(PEERS)/.installed:
	$(PYTHON) -m venv $(PEERS)/venv
	$(PEERS)/venv/bin/python -m pip install -q supervisor==4.3.0
	npm install --silent --no-audit --no-fund --prefix $(PEERS)/npm pm2@7.0.4
	touch $@

# gpuwarden, supervisord and PM2 side by side (and gpuwarden's own figures); writes
# bench/results/peers.{md,json} and the README's table.
bench: setup $(PEERS)/.installed
	$(BIN)/python bench/peers.py --readme README.md
	$(BIN)/python bench/shim.py
	$(BIN)/python bench/adopt.py
	$(BIN)/python bench/restart.py --repeat 1 --live-restore
	$(BIN)/python bench/weightcache.py
	$(BIN)/python bench/proxy.py

# The restart rows alone (crash -> next start, exit -> state change), N runs of interleaved
# rounds, each run with fresh tools: `make bench-repeat N=5`. Prints each run's medians,
# gpuwarden's ratio to PM2 and margin over the floor, then how many runs met the goals.
N ?= 5
bench-repeat: setup $(PEERS)/.installed
	$(BIN)/python bench/restart.py --repeat $(N)

# The shim's own figures: its memory, a flood captured through it, an adoption's share; then
# adoptions by real daemons after a SIGKILL.
bench-shim: setup
	$(BIN)/python bench/shim.py
	$(BIN)/python bench/adopt.py

# A dead child of the real SGLang (and of the stand-in): crash line -> group gone -> next exec.
bench-real: setup
	$(PYTHON) tests/real/env.py
	$(BIN)/python bench/deadchild.py
	$(BIN)/python bench/phases.py
	$(BIN)/python bench/compilecache.py
	$(BIN)/python bench/prewarm.py

# A bounded soak: 1,000 crash -> restart cycles with zero backoff; prints flat-or-not figures.
soak: setup
	$(BIN)/python bench/soak.py --cycles 1000
