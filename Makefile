# make demo: whole pipeline on the embedded default. make test: the test suite.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench install sysdeps clean

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

bench: $(STAMP)
	$(VENV)/bin/rolemrc bench all --out runs/bench

clean:
	rm -rf $(VENV) runs
