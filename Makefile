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

.PHONY: report test engine clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(if $(strip $(TORCH)),$(BIN)/pip install -q $(TORCH))
	$(BIN)/pip install -q -e ".[dev,fast,gpu,torch,peers]"
	$(MAKE) engine
	touch $(STAMP)

# The C++ CPU engine, built once for this machine's CPU and torch into the package's folder
# (src/layernorm/torch/_build/); again only when its sources, flags or torch change.
engine:
	$(BIN)/python -c "from layernorm.torch import _native; print(_native.build())"

report: $(STAMP) engine
	$(BIN)/layernorm report

# The tests run in one worker per core (JOBS=0: in this process alone), each test file in one
# worker, so a file's module fixtures are computed once.
JOBS ?= auto

# Then the tolerance tests of both APIs again with the engine switched off, where the NumPy
# fallback computes (what a machine without a compiler runs).
FALLBACK_TESTS := tests/test_cpu_family.py tests/torch_api/test_torch.py tests/torch_api/test_quant.py \
	tests/torch_api/test_torch_memory_efficient.py

test: $(STAMP) engine
	$(BIN)/ruff check src tests tools
	$(BIN)/python -m pytest -q -n $(JOBS) --dist loadfile
	LAYERNORM_NO_CPP=1 $(BIN)/python -m pytest -q -n $(JOBS) --dist loadfile $(FALLBACK_TESTS)

clean:
	rm -rf $(VENV) report .pytest_cache src/layernorm/torch/_build
