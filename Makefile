# fedasync: `make demo` and `make test` do all the set-up on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# CPU build of torch (takes seconds here, never a CUDA build). GPU users: make TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: install data demo test lint unit clean proto

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

data: $(STAMP)
	$(BIN)/python -m medical_data.fetch
	$(BIN)/python -m trainers.pipeline.corpus

demo: data
	$(BIN)/fedasync simulate

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/python -m pytest -m "not slow"

test: data lint
	$(BIN)/python -m pytest

proto: $(STAMP)
	$(BIN)/python -m server.erasure.gen_proto

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache .mypy_cache
