# Two commands do all set-up on a fresh machine: `make report` and `make test`. Both create
# .venv, build the package's wheel (the C++ CPU engine compiled in) and install it with every
# extra, non-editable: the tests run against what a user installs.
PYTHON ?= python3
# The torch pip installs first, options allowed: TORCH='torch==2.13.* --index-url
# https://download.pytorch.org/whl/cpu' for the CPU-only build on Linux (PyPI's is the CUDA
# build). The wheel's engine is built against it, so it must be the torch the `torch` extra pins.
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
ENVIRONMENT := $(VENV)/.environment
STAMP := $(VENV)/.installed
EXTRAS := dev,gpu,torch,peers
# The engine's builds, kept between wheel builds: an unchanged engine is not compiled again.
ENGINES := $(abspath $(VENV)/engines)
SOURCES := $(shell find src -type f -not -path '*/__pycache__/*' -not -path '*/_built/*' \
	-not -path '*.egg-info/*') \
	pyproject.toml setup.py README.md

.PHONY: report test dev wheel clean

# The virtual environment, torch and what the wheel's build needs (no build isolation: the
# engine is built against this torch).
$(ENVIRONMENT): Makefile
	$(PYTHON) -m venv $(VENV)
	$(if $(strip $(TORCH)),$(BIN)/pip install -q $(TORCH))
	$(BIN)/pip install -q "setuptools>=70.1" packaging
	touch $@

# dist/layernorm-<version>-py3-none-linux_x86_64.whl
wheel: $(ENVIRONMENT)
	rm -rf dist build
	LAYERNORM_ENGINE_DIR=$(ENGINES) $(BIN)/pip wheel -q --no-build-isolation --no-deps -w dist .

# The wheel of these sources, installed with every extra; again whenever a source changes.
$(STAMP): $(ENVIRONMENT) $(SOURCES)
	$(MAKE) wheel
	$(BIN)/pip install -q --force-reinstall --no-deps dist/layernorm-*.whl
	$(BIN)/pip install -q "$$(ls dist/layernorm-*.whl)[$(EXTRAS)]"
	touch $@

report: $(STAMP)
	$(BIN)/layernorm report

# The tests run in one worker per core (JOBS=0: in this process alone), each test file in one
# worker, so a file's module fixtures are computed once.
JOBS ?= auto

# Then the tolerance tests of both APIs again with the engine switched off, where the NumPy
# fallback computes (what a machine without the engine runs).
FALLBACK_TESTS := tests/test_cpu_family.py tests/torch_api/test_torch.py tests/torch_api/test_quant.py \
	tests/torch_api/test_torch_memory_efficient.py

test: $(STAMP)
	$(BIN)/ruff check src tests tools setup.py
	$(BIN)/python -m pytest -q -n $(JOBS) --dist loadfile
	LAYERNORM_NO_CPP=1 $(BIN)/python -m pytest -q -n $(JOBS) --dist loadfile $(FALLBACK_TESTS)

# For development: the package installed editable from src/ (its engine built into
# src/layernorm/engine/_built/), so an edit of a Python file needs no reinstall; an edit of
# csrc/ needs `make dev` again. `make test` installs the wheel again.
dev: $(ENVIRONMENT)
	LAYERNORM_ENGINE_DIR=$(ENGINES) $(BIN)/pip install -q --no-build-isolation -e ".[$(EXTRAS)]"
	rm -f $(STAMP)

clean:
	rm -rf $(VENV) report .pytest_cache build dist src/layernorm/engine/_built
