# Two commands on a fresh machine: `make demo` (the equivalence matrix and the pitfall catalogue) and `make test`
# (the suite against the wheel, installed as users install it). `make test-dev` runs it on the editable install.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The cases are tiny: one torch thread per process beats several fighting over 2 cores (the demo, the benchmarks).
# The suite runs without it, as users run pytest and the commands (equivcheck picks its own thread count).
export OMP_NUM_THREADS ?= 1
AS_USERS := env -u OMP_NUM_THREADS -u MKL_NUM_THREADS
# pytest-xdist workers for make test and make test-dev: the suite's time is in the processes its tests start
# (commands, ranks, pytest sessions), which two workers overlap (bench/README.md#the-suite). Whole files to a worker:
# a module's fixture (the catalogue's four precisions, 60 to 100 s) then runs once, not once on each worker.
WORKERS ?= 2
XDIST = -n $(WORKERS) --dist loadfile

.PHONY: install demo demo-full demo-parts installed-suite test test-full test-dev test-gpu test-frameworks bench bench-speed bench-threads bench-isolation bench-memory bench-scale bench-mesh bench-false-alarms bench-compile bench-locate bench-suite mutation clean

# The developer's venv: an editable install, for make demo, make test-dev and the benchmarks.
install: $(STAMP)

# The pinned CPU torch goes in first: with no torch installed, an open range pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check "$(TORCH)"
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $@

# One screen, about a minute of checks on an idle 2-core machine: the matrix's overview over the built-in cases, gloo
# DDP included, which ends by saying where the full matrix, the HTML report, the Markdown summary and torch's warnings
# are, then the tensor-parallel family. Torch's warnings and log lines go to a file beside each report
# (*.warnings.txt), counted in its last line.
# make demo-full: the pitfall catalogue in all four precisions first, then the field of reported bugs (its table in
# build/demo/), then the same matrix.
DEMO := build/demo
demo: install
	@$(MAKE) --no-print-directory demo-parts CATALOGUE= FIELD=
	@echo; echo "torch's warnings and log lines: $(DEMO)/*.warnings.txt; the full runs (the pitfall catalogue in every precision, the field of reported bugs, minutes more): make demo-full"

demo-full: install
	@$(MAKE) --no-print-directory demo-parts CATALOGUE=1 FIELD=1

demo-parts:
	@mkdir -p $(DEMO)
	@if [ -n "$(CATALOGUE)" ]; then $(BIN)/equivcheck catalogue --json $(DEMO)/catalogue.json > $(DEMO)/catalogue.txt || { cat $(DEMO)/catalogue.txt; exit 1; }; \
		tail -n 1 $(DEMO)/catalogue.txt; echo "the catalogue's tables: $(DEMO)/catalogue.txt"; fi
	@if [ -n "$(FIELD)" ]; then $(BIN)/equivcheck field --json $(DEMO)/field.json > $(DEMO)/field.txt 2> $(DEMO)/field.log || { cat $(DEMO)/field.txt $(DEMO)/field.log; exit 1; }; \
		tail -n 1 $(DEMO)/field.txt; echo "the field's table: $(DEMO)/field.txt"; fi
	@$(BIN)/equivcheck run --html $(DEMO)/report.html --markdown $(DEMO)/summary.md
	@echo; echo "tensor parallelism on meshes, and dropout on ranks, regime by regime:"
	@$(BIN)/equivcheck run --matrix --case tp_mlp --case checkpointed_dropout --warnings $(DEMO)/tp.warnings.txt | awk '/^cell:/ {done = 1} !done'

test-dev: install
	$(AS_USERS) $(BIN)/python -m pytest -q $(XDIST)

# make test checks what users install: the sdist of the tree as git sees it, the wheel built from that sdist, that wheel installed into its own
# venv, and the suite run from a copy of the tests, where nothing of the checkout is importable
# (tests/test_packaging.py asserts it, and that the wheel and the sdist hold every source file).
INSTALLED := build/installed$(if $(filter torch==2.13.0,$(TORCH)),,-$(subst ==,-,$(TORCH)))# one venv per TORCH=
INSTALLED_BIN := $(INSTALLED)/venv/bin
DIST := $(INSTALLED)/dist
SUITE := $(INSTALLED)/suite
SOURCE := $(INSTALLED)/source# the tree as a clone has it (with uncommitted work): no egg-info or build output leaks in

$(INSTALLED)/venv/.installed:
	rm -rf $(INSTALLED)/venv
	$(PYTHON) -m venv $(INSTALLED)/venv
	$(INSTALLED_BIN)/python -m pip install --quiet --disable-pip-version-check "$(TORCH)" build
	touch $@

# The wheel, installed, and a copy of the tests where nothing of the checkout is importable; then the suite there.
INSTALLED_SUITE = cd $(SUITE) && EQUIVCHECK_SOURCE_TREE="$(CURDIR)" EQUIVCHECK_DIST="$(CURDIR)/$(DIST)"
INSTALLED_PYTEST = ../venv/bin/python -m pytest -q -p no:cacheprovider $(XDIST)
installed-suite: $(INSTALLED)/venv/.installed
	rm -rf $(DIST) $(SUITE) $(SOURCE)
	mkdir -p $(SOURCE) && git ls-files -z --cached --others --exclude-standard \
		| tar --null --files-from=- --ignore-failed-read -cf - | tar -xf - -C $(SOURCE)
	$(INSTALLED_BIN)/python -m build --outdir $(DIST) $(SOURCE) > $(INSTALLED)/build.log
	$(INSTALLED_BIN)/python -m pip uninstall --quiet --yes equivcheck
	$(INSTALLED_BIN)/python -m pip install --quiet --disable-pip-version-check "$$(ls $(DIST)/*.whl)[test]"
	mkdir -p $(SUITE) && cp -r tests conftest.py pyproject.toml README.md $(SUITE)/

test: installed-suite
	$(INSTALLED_SUITE) $(AS_USERS) $(INSTALLED_PYTEST) --durations=15

# What make test samples, whole (conftest.py: the tests marked full_only or sampled, run with --full). CI runs both.
test-full: installed-suite
	$(INSTALLED_SUITE) $(AS_USERS) $(INSTALLED_PYTEST) --full -m "full_only or sampled"

# On a GPU machine, with the Python and torch installed there: the suite, the catalogue, the field and the matrix on
# the CPU default and with --device cuda, then the GPU bench (bench/gpu_check.sh; outputs in build/gpu).
test-gpu:
	PYTHON=$(PYTHON) bash bench/gpu_check.sh

# The framework recipes against pinned releases, installed after the pinned torch (pip keeps it), and the
# report and terminal extras (matplotlib, rich), whose plots and tables tests/test_reports.py then draws.
FRAMEWORKS ?= pytorch-lightning==2.6.6 accelerate==1.15.0 transformers==5.23.0 matplotlib==3.11.2 rich==15.0.0
FRAMEWORK_TESTS := tests/test_lightning.py tests/test_accelerate.py tests/test_hf_trainer.py tests/test_hf_located.py tests/test_hf_packed.py tests/test_reports.py
test-frameworks: install
	$(BIN)/python -m pip install --quiet --disable-pip-version-check "$(TORCH)" $(FRAMEWORKS)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q $(FRAMEWORK_TESTS)

bench: install bench-speed bench-threads bench-isolation
	$(BIN)/python bench/bench_pool.py

# What crash isolation and the precision preflight cost: isolated against in-process, quiet and busy.
bench-isolation: install
	env -u OMP_NUM_THREADS $(BIN)/python bench/bench_isolation.py

# The suite itself, serial against two workers, side by side (about 5 minutes here).
bench-suite: install
	$(BIN)/python bench/bench_suite.py

# A check with and without OMP_NUM_THREADS (unset for its probes, whatever this Makefile exports), quiet and busy.
bench-threads: install
	$(BIN)/python bench/bench_threads.py

# The peer trainparity, in its own venv (never a dependency of equivcheck), pinned CPU torch first.
PEER_VENV := bench/.peer-venv
$(PEER_VENV)/.installed:
	$(PYTHON) -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/python -m pip install --quiet --disable-pip-version-check "$(TORCH)" trainparity==0.1.0
	touch $@

# A check's cost against trainparity: in-process, CLI, verdicts, the full matrix, import and pytest --help.
bench-speed: install $(PEER_VENV)/.installed
	env -u OMP_NUM_THREADS $(BIN)/python bench/bench_speed.py

# Peak activation memory, wall time and process peak per regime, and what measuring costs.
bench-memory: install
	$(BIN)/python bench/memory.py

# A check on a 2 x 2 mesh (4 ranks) beside one on 2 ranks, and each beside torch alone training the same (a minute).
bench-mesh: install
	env -u OMP_NUM_THREADS $(BIN)/python bench/bench_mesh.py

# A check at real model sizes (MLPs of 1M, 25M and 100M parameters in process and on 2 DDP ranks, a 124M GPT-2-shaped
# transformer in process) beside torch alone training the same case: time and peak RSS as ratios (about 6 minutes).
bench-scale: install
	env -u OMP_NUM_THREADS $(BIN)/python bench/bench_scale.py

# False alarms of the broadened strategies: 10,000 in-process and 300 DDP faithful configurations, 2,000 attention LMs
# in process and 200 on DDP (about 45 min on 2 cores).
bench-false-alarms: install
	nice -n 10 $(BIN)/python bench/bench_false_alarms.py

# A compiled check's cost against torch alone's compiled trainings, quiet and busy; then the drawn configurations
# compiled by inductor (300), every one of which must be equivalent.
# What saying where a failed run parts costs at 25M and 124M parameters (bench/README.md#where-a-run-parts).
bench-locate: install
	cd bench && env -u OMP_NUM_THREADS ../$(BIN)/python bench_locate.py

bench-compile: install
	cd bench && ../$(BIN)/python bench_compile.py
	nice -n 10 $(BIN)/python bench/bench_false_alarms.py --in-process 0 --ddp 0 --pitfalls 0 --attention 0 \
		--attention-ddp 0 --attention-pitfalls 0 --tensor 0 --tensor-pitfalls 0 --resume 0 --compiled 300

# Mutation testing of the core modules (mutmut, an optional dev tool: the `mutation` extra; settings in
# pyproject.toml), then the kill rate per module and every mutant not killed. All 2,617 take many hours on 2 cores
# (one of check's _outcomes runs its 121 tests in up to 7 minutes): pick modules, e.g. MUTATE='equivcheck.process.seeding*',
# or a sample, e.g. MUTATE='equivcheck.*__mutmut_*[037]' (the mutants numbered ...0, ...3 or ...7: 3 in 10).
MUTATE ?= equivcheck.*
mutation: install
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[mutation]'
	rm -rf mutants
	nice -n 10 $(BIN)/mutmut run $(foreach m,$(MUTATE),"$(m)")
	$(BIN)/python tests/mutation/summary.py --survivors

clean:
	rm -rf $(VENV) build dist *.egg-info mutants
