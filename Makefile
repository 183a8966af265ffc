# make demo: whole pipeline on the embedded default. make test: the test suite. make lint: ruff.
# torch==2.13.0 is installed first because that CPU wheel is on disk on these machines: pyproject's
# `torch>=2.4` would otherwise resolve to the newest CUDA build (gigabytes). Any torch >= 2.4 works.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench lint install sysdeps clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

sysdeps:
	@bash scripts/system-deps.sh

demo: $(STAMP) sysdeps
	$(VENV)/bin/rolemrc demo --out runs/demo

test: $(STAMP) sysdeps
	$(PY) -m pytest -q -p no:cacheprovider

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	$(VENV)/bin/rolemrc bench all --out runs/bench

clean:
	rm -rf $(VENV) runs
