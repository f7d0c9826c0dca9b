"""The one persistence seam: every Redis key llmgw reads or writes, behind the facade `Store`.

A module per aggregate owns its keys (named in `llmgw.state.keys`) and how its records are encoded:
`nodes`, `replicas`, `loads`, `externals`, `endpoints`, `gateways`, `traffic`, `autoscale`,
`catalog`, `apikeys`, `events`, `kicks`, `agents` (wake-ups), `credentials`, `passes` (counters),
`weights` (sources' sizes and shapes, pulls), `adapters` (LoRA placement rows), `sends` (what the
gateways sent where, for each other's prefix indexes), `tenants` (the service each key received per
model, for fair queueing) and `locks`; `snapshots`
composes their batched reads into what one control pass decides on. `Store` is all of them over one
client, so callers keep one flat set of methods (`store.live_nodes()`, `store.create_key(...)`). No
decisions here, and no other module holds a Redis client: adding a
record means adding its key to `keys` and its reads and writes to its aggregate's module.
docs/store.md has the layout.
"""

from __future__ import annotations

import redis
from redis import RedisError

from llmgw.state.store.adapters import Adapters
from llmgw.state.store.agents import Agents
from llmgw.state.store.apikeys import ApiKeys
from llmgw.state.store.autoscale import Autoscale
from llmgw.state.store.catalog import HISTORY_LIMIT, Catalogs, CatalogOutline
from llmgw.state.store.credentials import Credentials
from llmgw.state.store.endpoints import Endpoints
from llmgw.state.store.events import Events
from llmgw.state.store.externals import Externals
from llmgw.state.store.gateways import Gateways
from llmgw.state.store.kicks import Kicks
from llmgw.state.store.loads import Loads
from llmgw.state.store.locks import Locks
from llmgw.state.store.nodes import Nodes
from llmgw.state.store.passes import Passes
from llmgw.state.store.replicas import Replicas
from llmgw.state.store.sends import Sends
from llmgw.state.store.snapshots import Snapshots
from llmgw.state.store.tenants import Tenants
from llmgw.state.store.traffic import Traffic
from llmgw.state.store.weights import Weights

__all__ = ["HISTORY_LIMIT", "CatalogOutline", "RedisError", "Store", "connect"]


def connect(url: str, **kw) -> redis.Redis:
    """A client with short timeouts: every caller is a loop that must not hang on a dead Redis."""
    kw.setdefault("socket_timeout", 5)
    kw.setdefault("socket_connect_timeout", 2)
    kw.setdefault("health_check_interval", 15)
    return redis.Redis.from_url(url, decode_responses=True, **kw)


class Store(Nodes, Replicas, Loads, Externals, Endpoints, Gateways, Traffic, Autoscale, Catalogs, ApiKeys,
            Events, Kicks, Agents, Credentials, Passes, Locks, Snapshots, Weights, Adapters, Sends, Tenants):
    """Every aggregate over one client. `r` is that client: for the aggregates, and for tests that
    check what landed in Redis."""

    def __init__(self, r: redis.Redis):
        self.r = r

    def ping(self) -> bool:
        """True when Redis answers; raises RedisError when it does not."""
        return bool(self.r.ping())

    def close(self) -> None:
        self.r.close()
