# Two commands on a fresh machine: `make demo` (the equivalence matrix) and `make test`.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The cases are tiny: one torch thread per process beats several fighting over 2 cores.
export OMP_NUM_THREADS ?= 1

.PHONY: install demo test bench clean

install: $(STAMP)

# The pinned CPU torch goes in first: with no torch installed, an open range pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check "$(TORCH)"
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $@

demo: install
	$(BIN)/equivcheck run

test: install
	$(BIN)/python -m pytest -q

bench: install
	$(BIN)/python bench/bench_pool.py

clean:
	rm -rf $(VENV) build *.egg-info
