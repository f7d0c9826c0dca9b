"""Where a request goes, and whether it waits: the gateway's routing core. No Flask, gevent or Redis.

- `tables`: what the endpoint list and the catalog say (names, aliases, external servers' keys),
  built by a pure function and swapped whole (`Snapshot`, with the loads and the per-endpoint stats);
- `load`, `speed`, `learn`: what an endpoint holds and how fast it serves, learned by pure functions
  that return new values (`EndpointStats` is what routing reads of one endpoint);
- `choice`: the pure `choose(...) -> Choice | Rejection` and its cost function `score`;
- `inflight`: the counts the request path changes (the only state it mutates, under their own lock),
  with what the other gateways said they hold (`othergateways`);
- `router`: the `Router` the request path uses: it holds the snapshot, and reserves and releases a
  slot per request in the counts;
- `exchange`: what the gateways tell each other over the same counts (sends, holds) and the facts of
  the gateway's report;
- `admission`: one pure step, `decide(result, queued, request, settings) -> Send | Queue | Refuse`:
  whether a routed request is sent, waits in its model's queue (saturated, a cold start, an adapter
  load) or is refused, and `after_wait` for what its wait came to; the proxy and bench/fleetsim.py
  both carry it out;
- `queue`, `retry`: the wait queue itself, and whether a failed attempt goes elsewhere.

A routing signal is a field of `EndpointStats` (or `Tables`), filled by the pure learner or table
builder, and a term in `choice.score`.
"""
