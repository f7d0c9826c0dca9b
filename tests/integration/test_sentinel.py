"""The store on a Sentinel-managed Redis (harness/sentinel.py: a master, a replica, three sentinels):
it follows a failover, leaves nobody on a demoted master, and a write that must not be lost waits for
a replica on the connection that wrote it."""

from __future__ import annotations

import os
import signal
import time

import pytest

from llmgw.catalog import apply_catalog, parse_catalog_text, read_applied
from llmgw.errors import NotReplicated
from llmgw.state.store import Durability, RedisError, Store, connect
from harness import needs
from harness.cluster import make_certs
from harness.procs import wait_until


def cat(replicas: int):
    return parse_catalog_text(f"models:\n  - {{name: chat, profiles: [{{name: s, engine: sim, replicas: {replicas}}}]}}\n")


def apply(store: Store, replicas: int) -> tuple[int, bool]:
    return apply_catalog(store, cat(replicas), source="test", applied_by="test")


@pytest.fixture
def ha(cluster):
    cluster.start_sentinel_redis(password="p@ss w/rd")  # URL-quoted in the URL
    return cluster


def test_the_store_follows_a_failover_and_nothing_confirmed_is_lost(ha):
    store = Store(connect(ha.redis_url), Durability(1, 2.0))
    version, _ = apply(store, 1)
    kid, _key = store.create_key("team")
    old = ha.ha.kill_master()
    new = ha.ha.wait_failover(old)
    # The same client, without being told: its next commands reach the promoted replica.
    wait_until(store.ping, 10, what="the store to reach the new master")
    assert store.r.connection_pool.get_master_address() == ("127.0.0.1", ha.ha.port(new))
    assert read_applied(store).version == version and kid in store.api_key_table()
    # Writes land on the new master; with no replica left, one that must not be lost says so.
    with pytest.raises(NotReplicated) as e:
        apply(store, 2)
    assert e.value.value == (version + 1, True) and e.value.acked == 0
    ha.ha.restart(old)
    ha.ha.wait_replica_of(old, new)
    # The old master is back as a replica: it holds the new version, and no client of ours.
    wait_until(lambda: ha.ha.client(old).get("llmgw:catalog") == store.catalog_document(), 10,
               what="the old master to replicate the new version")
    assert ha.ha.clients(old) == []
    store.close()


def test_a_demoted_master_that_stays_up_keeps_no_client(ha):
    """A coordinated failover (SENTINEL FAILOVER: the old master stays up and is made a replica): the
    sentinels disconnect its clients, and a client that still writes there gets READONLY, drops the
    connection and reconnects through the sentinels; either way the next write lands on the new master."""
    store = Store(connect(ha.redis_url))
    apply(store, 1)
    old = ha.ha.master()
    with ha.ha.client("sentinel-1") as s:
        s.execute_command("SENTINEL", "FAILOVER", "mymaster")
    new = ha.ha.wait_failover(old)
    ha.ha.wait_replica_of(old, new)

    def writes() -> bool:
        try:
            return apply(store, 3)[1]
        except RedisError:
            return False

    wait_until(writes, 15, what="a write after the switch")
    assert ha.ha.clients(old) == []
    store.close()


def test_a_confirmed_write_waits_for_a_replica_on_its_own_connection(ha):
    store = Store(connect(ha.redis_url), Durability(1, 0.5))
    apply(store, 1)
    # Fill the pool with idle connections that never wrote: a WAIT sent on one of them would count
    # the replica at once, whatever it holds.
    spare = [store.r.connection_pool.get_connection() for _ in range(3)]
    for c in spare:
        store.r.connection_pool.release(c)
    replica = next(n for n in ("redis-a", "redis-b") if n != ha.ha.master())
    pid = ha.ha.instances[replica].proc.pid
    os.kill(pid, signal.SIGSTOP)  # the replica stops acknowledging (it stays connected)
    try:
        started = time.monotonic()
        with pytest.raises(NotReplicated) as e:
            store.create_key("frozen")
        waited = time.monotonic() - started
        assert (e.value.acked, e.value.wanted) == (0, 1) and waited >= 0.5
        assert e.value.value[0] in store.api_key_table(), "the write stands on the master"
        assert "0 of 1 replica(s) acknowledged it within 0.5 s" in str(e.value)
        with pytest.raises(NotReplicated) as e:
            apply(store, 5)
        assert e.value.value == (2, True) and read_applied(store).version == 2
        assert apply(store, 5) == (2, False), "an unchanged apply writes nothing and waits for nothing"
        # Every other operator write that must not be lost waits the same way.
        for write in (lambda: store.update_key("frozen", rpm=5), lambda: store.revoke_key("frozen"),
                      lambda: store.set_node_admin("a", cordoned=True), lambda: store.rotate_credentials(None)):
            with pytest.raises(NotReplicated):
                write()
        assert store.key_names() == {} and store.node_admin("a").cordoned
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_until(lambda: ha.ha.link_up(replica), 10, what="the replica to resume")
    assert apply(store, 6)[1]
    store.close()


def test_a_celery_worker_survives_closing_a_channel_whose_connection_was_collected(ha):
    """What Celery's consumer does when the master dies: `collect()` detaches the transport from the
    connection, then the channel, still holding delivered and unacknowledged messages, is closed.
    kombu's own Sentinel channel raises AttributeError there (and the worker stops); ours raises a
    connection error, which the consumer ignores while it reconnects (workers/broker.py)."""
    from kombu import Connection
    from kombu.common import ignore_errors
    from kombu.transport import resolve_transport

    from llmgw.redisurl import celery_conf
    from llmgw.settings import ControlSettings
    from workers import broker
    from workers.celery_app import create_celery_app

    create_celery_app(ControlSettings(redis_url=ha.redis_url))  # installs the repaired transport
    assert resolve_transport("sentinel") is broker.SentinelTransport
    conf = celery_conf(ha.redis_url)
    conn = Connection(conf["broker_url"], transport_options=conf["broker_transport_options"])
    try:
        channel = conn.default_channel
        assert isinstance(channel, broker.SentinelChannel)
        queue = conn.SimpleQueue("llmgw-test", channel=channel)
        for i in range(3):
            queue.put({"i": i})
        held = [queue.get(timeout=5) for _ in range(2)]  # delivered, never acknowledged
        assert len(held) == 2
        channel._disconnect_pools()  # a first close got this far before the dead master's socket failed it
        conn.transport.client = None  # what Connection.collect() leaves
        ignore_errors(conn, channel.close)  # kombu's channel raises AttributeError here
    finally:
        conn.transport.client = conn
        ignore_errors(conn, conn.release)


def test_tls_to_the_sentinels_and_to_redis_for_the_store_and_the_broker(cluster, tmp_path):
    """`rediss+sentinel://`: TLS to the sentinels and to the master (the plain ports closed), for the
    store and for Celery's transport (`broker_use_ssl`, the sentinels' `ssl` options), before and after
    a failover. Needs a redis-server built with TLS (LLMGW_TEST_REDIS_SERVER; Debian's)."""
    from kombu import Connection

    from llmgw.redisurl import celery_conf

    needs.openssl()
    certs = tmp_path / "certs"
    certs.mkdir()
    cluster.start_sentinel_redis(password="pw", tls=make_certs(certs))
    url = cluster.redis_url
    assert url.startswith("rediss+sentinel://:pw@")
    store = Store(connect(url), Durability(1, 2.0))
    conf = celery_conf(url)

    def roundtrip(n: int) -> None:
        with Connection(conf["broker_url"], transport_options=conf["broker_transport_options"],
                        ssl=conf["broker_use_ssl"]) as conn:
            queue = conn.SimpleQueue("llmgw-tls")
            queue.put({"n": n})
            msg = queue.get(timeout=5)
            msg.ack()
            assert msg.payload == {"n": n}
            queue.close()

    version, _ = apply(store, 1)
    roundtrip(1)
    old = cluster.ha.kill_master()
    cluster.ha.wait_failover(old)
    wait_until(store.ping, 10, what="the store to reach the new master over TLS")
    assert read_applied(store).version == version
    roundtrip(2)
    store.close()
