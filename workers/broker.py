"""kombu's Redis Sentinel transport (`sentinel://`), with one repair the workers need to survive a failover.

When the master dies, Celery's consumer first `collect()`s the broken connection, which detaches the
transport from it (`transport.client = None`), then closes it. If a channel's first close failed half
way (the dead master reset its socket) and it still holds delivered, unacknowledged messages, the
second close tries to put them back, rebuilds its pool from `transport.client`, and kombu 5.7 raises
AttributeError ('NoneType' object has no attribute 'hostname'). That is not a connection error, so it
escapes the consumer's cleanup and the worker stops ("Unrecoverable error"): a control worker or a
node agent gone after a failover. Here that situation is a connection error (kombu ignores those
while closing), the consumer reconnects through the sentinels, and the unacknowledged messages stay
in Redis, where kombu puts them back once `visibility_timeout` has passed (our tasks are idempotent:
a pass kicked again, or not at all, changes nothing the next timer's pass would not).

`install()` makes the `sentinel` transport name mean this class in this process: kombu resolves it by
name again on every switch between the sentinels' URLs, so a `broker_transport` setting would not
hold. Only the Celery workers (and beat) install it; the gateway and the CLI only send.
"""

from __future__ import annotations

from kombu.transport import TRANSPORT_ALIASES, _transport_cache
from kombu.transport import redis as kombu_redis

NAME = "sentinel"
PATH = "workers.broker:SentinelTransport"


class SentinelChannel(kombu_redis.SentinelChannel):
    def _connparams(self, asynchronous: bool = False) -> dict:
        if self.connection is None or self.connection.client is None:
            # The builtin ConnectionError is an OSError, one of the transport's connection errors.
            raise ConnectionError("the broker connection is closed (unacknowledged messages come back "
                                  "after the visibility timeout)")
        return super()._connparams(asynchronous)


class SentinelTransport(kombu_redis.SentinelTransport):
    Channel = SentinelChannel


def install() -> None:
    """`sentinel://` means SentinelTransport in this process (idempotent)."""
    if TRANSPORT_ALIASES.get(NAME) != PATH:
        TRANSPORT_ALIASES[NAME] = PATH
        _transport_cache.pop(NAME, None)
