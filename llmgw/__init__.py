"""llmgw's shared domain package: catalog types, the Redis key schema, records, errors, config, CLI.

The gateway (gateway/), the Celery workers (workers/) and beat (beat/) all import from here; nothing
here imports from them.
"""

__version__ = "0.1.0"
