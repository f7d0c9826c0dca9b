"""The one persistence seam: every Redis key llmgw reads or writes, behind the facade `Store`.

A module per aggregate owns its keys (named in `llmgw.state.keys`) and how its records are encoded:
`nodes`, `replicas`, `loads`, `externals`, `endpoints`, `gateways`, `traffic`, `autoscale`,
`catalog`, `apikeys`, `events`, `kicks`, `agents` (wake-ups), `credentials`, `passes` (counters),
`weights` (sources' sizes and shapes, pulls), `adapters` (LoRA placement rows), `sends` (what the
gateways sent where, for each other's prefix indexes), `batches` (the Batch API's files, batches,
results and leases), `tenants` (the service each key received per model, for fair queueing),
`served` (how the gateways served the requests that asked to be explained) and `locks`; `snapshots`
composes their batched reads into what one control pass decides on. `Store` is all of them over one
client, so callers keep one flat set of methods (`store.live_nodes()`, `store.create_key(...)`). No
decisions here, and no other module holds a Redis client: adding a
record means adding its key to `keys` and its reads and writes to its aggregate's module.
docs/store.md has the layout.
"""

from __future__ import annotations

import redis
from redis import RedisError
from redis.sentinel import Sentinel

from llmgw.redisurl import SENTINEL_CONNECT_TIMEOUT, SENTINEL_SOCKET_TIMEOUT, Durability, parse

from llmgw.state.store.adapters import Adapters
from llmgw.state.store.agents import Agents
from llmgw.state.store.apikeys import ApiKeys
from llmgw.state.store.autoscale import Autoscale
from llmgw.state.store.batches import Batches
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
from llmgw.state.store.evictasks import EvictAsks
from llmgw.state.store.served import ServedRequests
from llmgw.state.store.snapshots import Snapshots
from llmgw.state.store.tenants import Tenants
from llmgw.state.store.traffic import Traffic
from llmgw.state.store.weights import Weights

__all__ = ["HISTORY_LIMIT", "CatalogOutline", "Durability", "RedisError", "Store", "connect"]


def connect(url: str, **kw) -> redis.Redis:
    """A client with short timeouts: every caller is a loop that must not hang on a dead Redis.

    `url` is one Redis (`redis://`, `rediss://`, `unix://`) or a master found through Sentinel
    (`redis+sentinel://`, `rediss+sentinel://`: llmgw.redisurl). Through Sentinel, every new connection
    asks the sentinels where the master is, so after a failover the client reconnects to the promoted
    replica; a connection to a master that was demoted meanwhile fails its next write (READONLY) and
    is dropped, and the command is retried on a new one. Raises RedisUrlInvalid (a ValueError) for a
    URL that names nothing."""
    kw.setdefault("socket_timeout", 5)
    kw.setdefault("socket_connect_timeout", 2)
    kw.setdefault("health_check_interval", 15)
    target = parse(url)
    if not target.sentinel:
        return redis.Redis.from_url(url, decode_responses=True, **kw)
    sentinels = Sentinel(target.sentinels, sentinel_kwargs={
        "socket_timeout": min(kw["socket_timeout"] or SENTINEL_SOCKET_TIMEOUT, SENTINEL_SOCKET_TIMEOUT),
        "socket_connect_timeout": min(kw["socket_connect_timeout"] or SENTINEL_CONNECT_TIMEOUT,
                                      SENTINEL_CONNECT_TIMEOUT),
        **target.sentinel_auth_kwargs(), **target.tls_kwargs()})
    return sentinels.master_for(target.master, redis_class=_SentinelMaster, decode_responses=True, db=target.db,
                                **target.auth_kwargs(), **target.tls_kwargs(), **kw)


class _SentinelMaster(redis.Redis):
    """The master's client; closing it closes its connections to the sentinels too."""

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.connection_pool.sentinel_manager.close()


class Store(Nodes, Replicas, Loads, Externals, Endpoints, Gateways, Traffic, Autoscale, Catalogs, ApiKeys,
            Events, Kicks, Agents, Credentials, Passes, Locks, Snapshots, Weights, Adapters, Sends, Batches,
            Tenants, ServedRequests, EvictAsks):
    """Every aggregate over one client. `r` is that client: for the aggregates, and for tests that
    check what landed in Redis. `durability`: how many replicas must hold a catalog apply or an API
    key's change before it returns (llmgw.redisurl.Durability; the roles pass `Settings.durability`)."""

    def __init__(self, r: redis.Redis, durability: Durability | None = None):
        self.r = r
        # What a write that must not be lost waits for (`Aggregate.durably`); none by default.
        self.durability = durability or Durability()

    def ping(self) -> bool:
        """True when Redis answers; raises RedisError when it does not."""
        return bool(self.r.ping())

    def close(self) -> None:
        self.r.close()
