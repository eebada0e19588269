# zero_ext — set-up, build, test, demo. Every target does its own set-up and is idempotent.
#   make test    build everything (venv, torch, the extension) and pass the tests
#   make check   the quick tier: the C core's tests and every test that starts no process
#                (pytest -m "not dist and not slow", tests/conftest.py); under 2 minutes after the build
#   make demo    the main job: GPT training on 2 CPU ranks, ZeRO vs DDP, side by side
#   make docs    the documentation site (mkdocs --strict) into build/site; make test builds it too
#   make bench   the benchmarks (tables + JSON under benchmarks/results/); installs DeepSpeed, a peer
#   make gpu-check  on a GPU machine whose python has torch+CUDA, pybind11, ninja, pytest:
#                builds, runs the GPU tests, compute-sanitizer and GPU benchmarks; installs nothing;
#                at most 20 min on one H100; results in benchmarks/reference/<gpu>/gpu-check.json
# A user with a torch of their own (e.g. CUDA) keeps it: make ZX_SYSTEM_TORCH=1 ...
# builds the venv on top of the system site-packages and installs no torch.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
DEEPSPEED_VERSION ?= 0.19.8
TRANSFORMERS_VERSION ?= 5.23.0
PEFT_VERSION ?= 0.21.2
ZX_SYSTEM_TORCH ?= 0
PYTEST_ARGS ?=
# make test runs the test files on this many pytest workers (pytest-xdist, a file per worker at
# a time: its standing worlds stay in one process); 1: one process, as pytest alone
PYTEST_JOBS ?= 2
SOURCES := $(wildcard csrc/*.cpp csrc/*.h csrc/engine/*.cpp csrc/engine/*.h csrc/core/*.c csrc/core/*.h csrc/core/*.inc csrc/cuda/*.cu csrc/cuda/*.h csrc/cuda/*.cuh) setup.py

.PHONY: all venv build test check core-test docs pytest demo bench gpu-check clean

all: build

# What the build needs (torch and the compilers' helpers), then the rest: test, notebook
# and docs dependencies; transformers and peft for tests/test_hf_models.py and
# tests/test_meta_init.py (Hugging Face models built from small configs, nothing downloaded).
# The extension builds while the rest installs (make test runs with -j: Note [Parallel set-up]).
$(VENV)/.build-deps: Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(if $(filter 1,$(ZX_SYSTEM_TORCH)),--system-site-packages) $(VENV)
	@if $(PY) -c "import torch" 2>/dev/null; then \
	    echo "using torch $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	else \
	    $(PY) -m pip install -q "torch==$(TORCH_VERSION)"; \
	fi
	$(PY) -m pip install -q "setuptools>=64" wheel pybind11 ninja numpy
	@touch $@

$(VENV)/.deps: $(VENV)/.build-deps
	$(PY) -m pip install -q pytest "pytest-xdist==3.8.0" nbconvert nbclient ipykernel matplotlib tqdm \
	    "transformers==$(TRANSFORMERS_VERSION)" "peft==$(PEFT_VERSION)" "lightning==2.6.6" "accelerate==1.15.0"
	$(PY) -m pip install -q "mkdocs==1.6.1" "mkdocstrings==1.0.8" "mkdocstrings-python==2.0.11"
	@touch $@

venv: $(VENV)/.deps

# The extension builds in place (incremental with ninja); a .pth file puts the
# repository on the venv's path, so `import zero_ext` works from anywhere.
$(VENV)/.built: $(VENV)/.build-deps $(SOURCES)
	$(PY) setup.py -q build_clib build_ext --inplace
	$(PY) -c "import site, os; open(os.path.join(site.getsitepackages()[0], 'zero_ext_repo.pth'), 'w').write(os.getcwd() + '\\n')"
	@touch $@

build: $(VENV)/.built $(VENV)/.deps

core-test:
	$(MAKE) -C csrc/core -j2 test

# Many tests wait (on ranks, rendezvous, timeouts) about a third of the time: two workers
# keep the cores busy (tests/conftest.py, Note [Test workers]).
pytest: build
	$(PY) -m pytest -q --durations=25 $(if $(filter-out 1,$(PYTEST_JOBS)),-n $(PYTEST_JOBS) --dist loadfile --no-loadscope-reorder) $(PYTEST_ARGS) tests

# The site's tables come from benchmarks/reference/ and the sources (tools/docsgen.py, the
# mkdocs hook); --strict fails on a broken link, a missing API entry or a stale table.
docs: $(VENV)/.deps
	$(PY) -m mkdocs build --strict -q

# Note [Parallel set-up]
#   On a fresh machine make test spends ~40 s installing the test, notebook and docs
#   dependencies with one core and ~75 s compiling the extension's two translation units
#   (Note [Unity build] in setup.py); the C core's sanitized tests take ~7 s and the docs
#   ~5 s. None needs another's output but the build's own dependencies (.build-deps), so
#   make test runs them as parallel jobs: pip installs while the extension compiles. The
#   installs never change a package the build uses (pinned versions; checked with
#   pip install --dry-run --report against the build's set).
test:
	@$(MAKE) --no-print-directory -j3 core-test docs pytest

check: core-test build
	$(PY) -m pytest -q -m "not dist and not slow" --durations=10 $(PYTEST_ARGS) tests

demo: build
	$(PY) examples/demo.py

# DeepSpeed is a peer in bench_step.py, for make bench only (make test never needs it). It
# builds against the venv's torch (no build isolation, which would fetch another torch);
# if it does not install, the benchmark reports it as not installed and pip's output
# stays in benchmarks/results/deepspeed_install.log.
$(VENV)/.bench-deps: $(VENV)/.deps
	@mkdir -p benchmarks/results
	@if $(PY) -m pip install -q --no-build-isolation "deepspeed==$(DEEPSPEED_VERSION)" \
	        > benchmarks/results/deepspeed_install.log 2>&1; then \
	    echo "deepspeed $(DEEPSPEED_VERSION) installed"; \
	else \
	    echo "deepspeed $(DEEPSPEED_VERSION) did not install (see benchmarks/results/deepspeed_install.log)"; \
	fi
	@touch $@

bench: build $(VENV)/.bench-deps
	$(PY) benchmarks/bench_optimizer.py
	$(PY) benchmarks/bench_step.py
	$(PY) benchmarks/bench_units.py
	$(PY) benchmarks/bench_memory.py
	$(PY) benchmarks/bench_memory_peers.py
	$(PY) benchmarks/bench_comm.py
	$(PY) benchmarks/bench_comm_hier.py
	$(PY) benchmarks/bench_whole.py
	$(PY) -m nbconvert --to notebook --execute --ExecutePreprocessor.timeout=1800 \
	    --output-dir benchmarks/results --output zero_vs_ddp.executed.ipynb benchmarks/zero_vs_ddp.ipynb

# No venv, no pip: the GPU machine has no package registry (see .ci/gpu-check).
gpu-check:
	PYTHON=$(PYTHON) bash .ci/gpu-check

clean:
	rm -rf build zero_ext/*.so $(VENV)/.built
	$(MAKE) -C csrc/core clean
