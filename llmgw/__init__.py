"""llmgw's shared domain package, one subpackage per part:

- `catalog/`: the catalog's types, validation, YAML loading, diff, storage in Redis and file watch;
- `engines/`: the engine drivers (vllm, llamacpp, sim) and reading their `/metrics`;
- `state/`: the Redis key schema, records, derived replica state, the store, API keys, the clock;
- `proc/`: the process table and local ports;
- `local/`: the whole system on one machine (`llmgw up`); `cli/`: the `llmgw` command;
- `errors.py`, `settings.py`, `gpus.py`: the error vocabulary, settings from the environment, GPU names.

The gateway (gateway/), the Celery workers (workers/) and beat (beat/) import from here; nothing here
imports from them (import-linter contracts in pyproject.toml).
"""

__version__ = "0.1.0"
