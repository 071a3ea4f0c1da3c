# Developer entry points. `make demo` and `make test` set up .venv on first use.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test lint proto bench-numpy clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/q6serve demo

lint: $(STAMP)
	$(BIN)/ruff check .

test: lint
	$(BIN)/python -m pytest -q

proto: $(STAMP)
	PYTHON=$(BIN)/python scripts/gen_proto.sh

bench-numpy: $(STAMP)
	$(BIN)/python bench/numpy_backend.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
