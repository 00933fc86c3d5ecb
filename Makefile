# make demo · make test · make bench — each bootstraps .venv on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
# A CPU build of torch; override on a CUDA machine, e.g. make test TORCH=torch==2.13.0+cu126
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.memopt-installed

.PHONY: demo test check durations lint bench bench-quick clean

# pip compiles every file it installs to bytecode one at a time; compileall does it on all cores
# (where PYTHONDONTWRITEBYTECODE is set, an uncompiled module is compiled again at every import;
# a file a package ships that is not valid Python fails only itself, hence || true).
# torch brings the setuptools the editable build needs, so no isolated build environment.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install --quiet --no-compile "$(TORCH)"
	$(BIN)/pip install --quiet --no-compile --no-build-isolation -e ".[dev]"
	$(BIN)/python -m compileall -q -j 0 $$($(BIN)/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") > /dev/null || true
	touch $(STAMP)

# The demo's output and picture are the ones docs/ shows: each run rewrites them.
demo: $(STAMP)
	bash -o pipefail -c '$(BIN)/python examples/demo.py --config configs/int4_drift.yaml \
		--log-dir lightning_logs 2>&1 | tee docs/demo-output.txt'
	cp lightning_logs/demo/demo.png docs/demo.png

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Without a C compiler the CPU codec's tests would skip: fail instead (CC may carry arguments).
# JOBS pytest-xdist workers (default 2: CI's cores; 3 took longer, 13 min 14 s against 12 min 35 s
# from a clean clone), each with its share of the cores' threads (tests/conftest.py); most of the
# time is torch.compile.
# loadgroup: the tests of a module that share a fixture (a 2-process run, a measured baseline)
# run on one worker; the longest start first (measured: tests/durations.json), hence
# --no-loadscope-reorder. JOBS=0: one process. make check: lint and the tests measured at 3 s or
# less that share no costly module fixture (no compiling, no spawned processes), for the edit loop;
# make durations measures the whole suite again into durations.json.
JOBS ?= 2
PYTEST := $(BIN)/python -m pytest -q -n $(JOBS) --dist loadgroup --no-loadscope-reorder
test: lint cc
	$(PYTEST)

check: lint cc
	$(PYTEST) --quick

durations: $(STAMP) cc
	$(PYTEST) --store-durations

.PHONY: cc
cc:
	@set -- $${CC:-cc}; command -v "$$1" >/dev/null || \
		{ echo "make test: no C compiler ($${CC:-cc}); the CPU codec needs one" >&2; exit 1; }

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run --out benchmarks
	$(BIN)/python -m benchmarks.fits --out benchmarks
	$(BIN)/python -m benchmarks.depth --out benchmarks
	$(BIN)/python -m benchmarks.bits_both_ways --out benchmarks
	$(BIN)/python -m benchmarks.compile_time --out benchmarks
	$(BIN)/python -m benchmarks.step_time --out benchmarks
	$(BIN)/python -m benchmarks.drift_check_time --out benchmarks
	$(BIN)/python -m benchmarks.plot_fits

bench-quick: $(STAMP)
	$(BIN)/python -m benchmarks.run --quick --out /tmp/memopt-bench

clean:
	rm -rf $(VENV) build *.egg-info
