# fedasync: `make demo` and `make test` do all the set-up on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# CPU build of torch (takes seconds here, never a CUDA build). GPU users: make TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed
# pytest-xdist workers: three on two cores, since most slow tests wait on the processes they
# start (Flower's SuperLink and SuperNodes, Ray) rather than compute; a file's tests stay on one
# worker (--dist loadfile), as some share one expensive run (docs/testing.md)
WORKERS ?= 3

.PHONY: install data demo test lint unit coverage clean proto browser

# pip compiles every installed file to bytecode on one core; compileall does it on all of them
# (a third-party file that is not valid Python 3.11, such as torch's py312 test helper, is
# skipped as pip skips it)
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q --no-compile $(TORCH)
	$(BIN)/python -m pip install -q --no-compile -e ".[dev,hf,mlflow]"
	$(BIN)/python -m compileall -qq -j 0 $$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))') || true
	touch $(STAMP)

install: $(STAMP)

data: $(STAMP)
	$(BIN)/python -m medical_data.fetch
	$(BIN)/python -m trainers.pipeline.corpus

demo: data
	$(BIN)/fedasync simulate lab.compare_sync=true

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# `serial` tests make orphaned processes that another test's start-up sweep would take: alone, first
unit: $(STAMP)
	$(BIN)/python -m pytest -m "serial and not slow"
	$(BIN)/python -m pytest -m "not slow and not serial" -n $(WORKERS) --dist loadfile

# Debian's chromium for the erasure certificate's browser test: installed when missing and we
# are root with apt (as on CI); otherwise that one test skips and says what to install
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
	  && (apt-get install -y -q chromium >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 \
	      && apt-get install -y -q chromium >/dev/null 2>&1)) \
	  && echo "installed chromium (the certificate's browser test)"; } \
	  || echo "no chromium: the certificate's browser test will skip (apt-get install -y chromium)"

# The environment and data, with Debian's chromium installed beside them (apt and pip do not
# wait on each other); then ruff; then mypy (a minute of one core) beside the serial tests,
# which mostly wait on the processes they start: its report is printed after them, and either
# failing fails the target; then the rest on the workers
test:
	@$(MAKE) --no-print-directory -j2 data browser
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	@log=$$(mktemp); $(BIN)/mypy >$$log 2>&1 & typing=$$!; \
	  $(BIN)/python -m pytest -m serial; serial=$$?; \
	  wait $$typing; typed=$$?; echo "mypy:"; cat $$log; rm -f $$log; \
	  [ $$serial -eq 0 ] && [ $$typed -eq 0 ]
	$(BIN)/python -m pytest -m "not serial" -n $(WORKERS) --dist loadfile --durations=25

# line coverage of the eight packages, subprocesses included (runs/coverage/)
coverage: data
	rm -rf runs/coverage && mkdir -p runs/coverage
	$(BIN)/python -m coverage run -m pytest -m serial
	$(BIN)/python -m coverage run -m pytest -m "not serial" -n $(WORKERS) --dist loadfile
	$(BIN)/python -m coverage combine -q
	$(BIN)/python -m coverage report --precision=2 | tail -1

proto: $(STAMP)
	$(BIN)/python -m server.erasure.gen_proto

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache .mypy_cache
