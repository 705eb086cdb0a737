# hybridflow — the two commands a new user types: `make quickstart` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# CPU machines get the CPU build of torch (an unpinned torch pulls a multi-GB CUDA build); GPU machines keep theirs.
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= dev,ray,tracking,math,lowbit

.PHONY: setup sandbox-tool quickstart test lint clean

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1; then echo "GPU found: installing torch from PyPI"; \
	  $(BIN)/pip install -q torch; else $(BIN)/pip install -q "$(TORCH_SPEC)"; fi
	$(BIN)/pip install -q -e ".[$(EXTRAS)]"
	touch $@

setup: $(BIN)/.installed sandbox-tool

# Code rewards prefer bubblewrap; without it they use our namespace launcher, so this never fails the setup.
sandbox-tool:
	@command -v bwrap >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  { echo "installing bubblewrap (code-reward sandbox)"; apt-get install -y -qq bubblewrap >/dev/null 2>&1 || \
	    { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq bubblewrap >/dev/null 2>&1; } || \
	    echo "bubblewrap not installed; code rewards will use the namespace sandbox"; }; } || true

quickstart: setup
	$(BIN)/hybridflow quickstart

lint: setup
	$(BIN)/ruff check hybridflow tests benchmarks

# pytest exit code 5 = no tests collected: not a failure. One intra-op thread per process: tests start several
# processes (gloo ranks, Ray actors, reward pools) on 2 cores, and oversubscribed OpenMP threads slow them ~10x.
# TEST_WORKERS pytest-xdist workers (one per core of the 2-core CI box), whole files per worker (`loadfile`: a
# module's fixtures — one Ray cluster, one trained model — are built once), handed out longest first
# (`--no-loadscope-reorder` keeps the order tests/conftest.py sorts them in); TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
test: setup lint
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 tests; rc=$$?; if [ $$rc -eq 5 ]; then rc=0; fi; exit $$rc

clean:
	rm -rf $(VENV) runs checkpoints .pytest_cache
