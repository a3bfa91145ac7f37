# Two commands do all set-up on a fresh machine: `make report` and `make test`.
# Both create .venv and install the package with every extra into it.
PYTHON ?= python3
# A CPU build of torch; set TORCH= to keep whatever torch pip would choose.
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: report test clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e ".[dev,fast,gpu,torch]"
	touch $(STAMP)

report: $(STAMP)
	$(BIN)/layernorm report

test: $(STAMP)
	$(BIN)/ruff check src tests tools
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) report .pytest_cache
