"""What every aggregate of the store shares: the client, the pipeline type, and small decoders."""

from __future__ import annotations

import json
from typing import Any, Callable, Iterable, Mapping, TypeVar

import redis

from llmgw.errors import NotReplicated
from llmgw.redisurl import Durability

Pipeline = redis.client.Pipeline
T = TypeVar("T")


class Aggregate:
    """One aggregate's reads and writes over `self.r`; `Store` is every aggregate over one client.
    An aggregate may call another's methods through `self` (they all end up on the one facade)."""

    r: redis.Redis
    durability: Durability

    def durably(self, what: str, write: Callable[[redis.Redis], T], wrote: Callable[[T], bool] = lambda _v: True) -> T:
        """`write(client)`, then, when `durability` asks for replicas, WAIT until that many hold it.

        A write that must not be lost in a failover (Redis replicates asynchronously: what the master
        acknowledged may not have reached the replica Sentinel promotes). WAIT counts the replicas that
        have what *its own connection* wrote, so `write` runs on a client lent one connection of the
        pool (its commands, pipelines and transactions all use it) and WAIT follows on that connection.
        Fewer acknowledgements than asked within the timeout raise NotReplicated, which carries what
        `write` returned: the write stands on the master. A connection re-established between the write
        and the WAIT counts as no acknowledgement (that WAIT would count nothing of ours). `wrote(value)`
        false: `write` changed nothing, and nothing is waited for."""
        d = self.durability
        if d.replicas <= 0:
            return write(self.r)
        lease = _Lease(self.r.connection_pool)
        try:
            client = redis.Redis(connection_pool=lease)
            value = write(client)
            if not wrote(value):
                return value
            lease.reconnected = False
            acked = int(client.wait(d.replicas, ms(d.timeout)))
            if lease.reconnected:
                acked = 0
        finally:
            lease.close()
        if acked < d.replicas:
            raise NotReplicated(what, acked, d.replicas, d.timeout, value)
        return value


class _Lease:
    """One connection of `pool`, lent to a client built on this object for a short sequence of commands:
    every command, pipeline and transaction of that client runs on it, and it goes back to the pool at
    `close`. Everything else is the pool's. `reconnected` turns true whenever the connection connects
    (again)."""

    def __init__(self, pool: redis.ConnectionPool):
        self._pool = pool
        self.connection = pool.get_connection()
        self.reconnected = False
        self.connection.register_connect_callback(self._connected)

    def _connected(self, _connection) -> None:
        self.reconnected = True

    def get_connection(self, *_args, **_kw):
        return self.connection

    def release(self, _connection) -> None:
        pass  # kept until close()

    def close(self) -> None:
        self.connection.deregister_connect_callback(self._connected)
        self._pool.release(self.connection)

    def __getattr__(self, name: str):
        return getattr(self._pool, name)


def ms(seconds: float) -> int:
    """A TTL in whole milliseconds (PX), never zero: a zero TTL is an error in Redis."""
    return max(1, int(seconds * 1000))


def floats(h: Mapping[str, str]) -> dict[str, float]:
    """A hash of name -> number; unreadable entries are skipped."""
    out = {}
    for name, raw in h.items():
        try:
            out[name] = float(raw)
        except ValueError:
            pass
    return out


def decoded(raws: Iterable[str | None], parse: Callable[[Any], T]) -> list[T]:
    """`parse(json.loads(raw))` of each present value; a value from a newer or broken writer is skipped
    (read afresh next time, never fatal to the reader)."""
    out = []
    for raw in raws:
        if raw:
            try:
                out.append(parse(json.loads(raw)))
            except (ValueError, TypeError):
                continue
    return out


def compact(doc: Any, **kw) -> str:
    """JSON without spaces (values written often or read by many)."""
    return json.dumps(doc, separators=(",", ":"), **kw)
