# Two commands do all set-up on a fresh machine: `make report` and `make test`.
# Both create .venv and install the package with every extra into it.
PYTHON ?= python3
# The torch pip installs first, options allowed: TORCH='torch --index-url
# https://download.pytorch.org/whl/cpu' for the CPU-only build on Linux (PyPI's is the CUDA
# build); TORCH= (empty) installs none beyond what the extras ask for.
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: report test clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(if $(strip $(TORCH)),$(BIN)/pip install -q $(TORCH))
	$(BIN)/pip install -q -e ".[dev,fast,gpu,torch,peers]"
	touch $(STAMP)

report: $(STAMP)
	$(BIN)/layernorm report

# The tests run in one worker per core (JOBS=0: in this process alone), each test file in one
# worker, so a file's module fixtures are computed once.
JOBS ?= auto

test: $(STAMP)
	$(BIN)/ruff check src tests tools
	$(BIN)/python -m pytest -q -n $(JOBS) --dist loadfile

clean:
	rm -rf $(VENV) report .pytest_cache
