"""llmgw's shared state: the key schema (`keys`), the records (`records`), the state derived from them
(`replica_state`), API key policy (`keypolicy`), the event type (`events`), the views a control pass
reads (`views`), the clock seam (`clock.Clock`), and `store`: the one package that talks to Redis, a
module per aggregate behind the facade `store.Store`. No decisions here beyond the pure rules."""
