# Two commands on a fresh machine: `make demo` (the equivalence matrix and the pitfall catalogue) and `make test`.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The cases are tiny: one torch thread per process beats several fighting over 2 cores.
export OMP_NUM_THREADS ?= 1

.PHONY: install demo test bench bench-speed bench-memory bench-false-alarms mutation clean

install: $(STAMP)

# The pinned CPU torch goes in first: with no torch installed, an open range pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check "$(TORCH)"
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $@

demo: install
	$(BIN)/equivcheck run
	$(BIN)/equivcheck catalogue

test: install
	$(BIN)/python -m pytest -q

bench: install bench-speed
	$(BIN)/python bench/bench_pool.py

# The peer trainparity, in its own venv (never a dependency of equivcheck), pinned CPU torch first.
PEER_VENV := bench/.peer-venv
$(PEER_VENV)/.installed:
	$(PYTHON) -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/python -m pip install --quiet --disable-pip-version-check "$(TORCH)" trainparity==0.1.0
	touch $@

# A check's cost against trainparity: in-process, CLI, verdicts, the full matrix, import and pytest --help.
bench-speed: install $(PEER_VENV)/.installed
	$(BIN)/python bench/bench_speed.py

# Peak activation memory, wall time and process peak per regime, and what measuring costs.
bench-memory: install
	$(BIN)/python bench/memory.py

# False alarms of the broadened strategies: 10,000 in-process and 300 DDP faithful configurations (about 40 min on 2 cores).
bench-false-alarms: install
	nice -n 10 $(BIN)/python bench/bench_false_alarms.py

# Mutation testing of the core modules (mutmut, an optional dev tool: the `mutation` extra; settings in
# pyproject.toml). All of them take hours on 2 cores: pick modules, e.g. make mutation MUTATE='equivcheck.seeding*'.
MUTATE ?= equivcheck.*
mutation: install
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[mutation]'
	rm -rf mutants
	nice -n 10 $(BIN)/mutmut run $(foreach m,$(MUTATE),"$(m)")
	$(BIN)/mutmut results

clean:
	rm -rf $(VENV) build *.egg-info mutants
