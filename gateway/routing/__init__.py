"""Where a request goes, and whether it waits: the gateway's routing core. No Flask, gevent or Redis.

- `tables`: what the endpoint list and the catalog say (names, aliases, external servers' keys),
  built by a pure function and swapped whole (`Snapshot`, with the loads and the per-endpoint stats);
- `load`, `speed`, `learn`: what an endpoint holds and how fast it serves, learned by pure functions
  that return new values (`EndpointStats` is what routing reads of one endpoint);
- `choice`: the pure `choose(...) -> Choice | Rejection` and its cost function `score`;
- `inflight`: the counts the request path changes (the only state it mutates);
- `router`: the `Router` that holds the snapshot and the counts and reserves a slot per request;
- `admission`, `queue`, `coldstart`, `retry`: whether a request is sent, queued, held for a cold
  start or shed, and whether a failed attempt goes elsewhere.

A routing signal is a field of `EndpointStats` (or `Tables`), filled by the pure learner or table
builder, and a term in `choice.score`.
"""
