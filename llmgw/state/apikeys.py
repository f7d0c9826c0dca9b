"""The names gateway/*.py imports from here, now in `llmgw.state.keypolicy` (the record and its
policy); the Redis side is the store's (`Store.create_key`, `list_keys`, ...). Import from keypolicy."""

from llmgw.state.keypolicy import (  # noqa: F401 - re-exported
    ANONYMOUS,
    PRIORITIES,
    ApiKeyRecord,
    Priority,
    budget_status,
    cap_priority,
    hash_key,
    parse_table,
    usage_by_model,
)
