"""llmgw's state in Redis: the key schema (`keys`), the records (`records`), the state derived from
them (`replica_state`), the thin access layer (`store.Store`), API keys (`apikeys`), and the clock
seam (`clock.Clock`). No decisions here beyond `replica_state.derive`."""
