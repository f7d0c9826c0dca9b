"""Nodes: heartbeats (a key with a TTL per node), the set of every node that ever sent one, when each
was last seen and since when it is missing, and the operator's flags (cordoned, draining)."""

from __future__ import annotations

import json
from typing import Iterable, Iterator, Mapping, Sequence

from llmgw.state import keys
from llmgw.state.node_records import NodeAdmin, NodeInfo
from llmgw.state.store.base import Aggregate, Pipeline, floats, ms


# --- reads a snapshot composes with other aggregates' (queue on one pipeline, take the replies in order)
def queue_names(pipe: Pipeline) -> None:
    pipe.smembers(keys.NODES)


def queue_last_seen(pipe: Pipeline) -> None:
    pipe.hgetall(keys.NODES_LAST_SEEN)


def take_last_seen(replies: Iterator) -> dict[str, float]:
    return floats(next(replies))


def queue_missing_since(pipe: Pipeline) -> None:
    pipe.hgetall(keys.NODES_MISSING_SINCE)


def take_missing_since(replies: Iterator) -> dict[str, float]:
    return floats(next(replies))


def queue_heartbeats(pipe: Pipeline, names: Sequence[str]) -> None:
    if names:
        pipe.mget([keys.node_heartbeat(n) for n in names])


def take_live(names: Sequence[str], replies: Iterator) -> dict[str, NodeInfo]:
    """The nodes of `names` whose heartbeat is present."""
    raws = next(replies) if names else []
    return {n: NodeInfo.from_dict(json.loads(v)) for n, v in zip(names, raws) if v}


def queue_admin(pipe: Pipeline, names: Iterable[str]) -> None:
    for n in names:
        pipe.hgetall(keys.node_admin(n))


def take_admin(names: Sequence[str], replies: Iterator) -> dict[str, NodeAdmin]:
    return {n: _admin(next(replies)) for n in names}


def _admin(h: Mapping[str, str]) -> NodeAdmin:
    return NodeAdmin(cordoned=h.get("cordoned") == "1", draining=h.get("draining") == "1")


class Nodes(Aggregate):
    def write_heartbeat(self, info: NodeInfo, ttl: float) -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.set(keys.node_heartbeat(info.name), json.dumps(info.to_dict()), px=ms(ttl))
        pipe.sadd(keys.NODES, info.name)
        if info.heartbeat_at:
            pipe.hset(keys.NODES_LAST_SEEN, info.name, repr(info.heartbeat_at))
        pipe.execute()

    def nodes_last_seen(self) -> dict[str, float]:
        """Node name -> time of its last heartbeat (also for nodes whose heartbeat has expired)."""
        return floats(self.r.hgetall(keys.NODES_LAST_SEEN))

    def forget_nodes(self, names: Iterable[str]) -> None:
        """Drop every trace of nodes that are gone for good (housekeeping decides which)."""
        names = list(names)
        if not names:
            return
        pipe = self.r.pipeline(transaction=False)
        pipe.srem(keys.NODES, *names)
        pipe.hdel(keys.NODES_MISSING_SINCE, *names)
        pipe.hdel(keys.NODES_LAST_SEEN, *names)
        for name in names:
            pipe.delete(keys.agent_wake(name), keys.node_replicas(name), keys.node_admin(name))
        pipe.execute()

    def nodes_missing_since(self) -> dict[str, float]:
        """Node -> when housekeeping first saw it without a heartbeat (unreadable entries are skipped:
        their clock starts again)."""
        return floats(self.r.hgetall(keys.NODES_MISSING_SINCE))

    def note_missing_nodes(self, first_missing: Mapping[str, float],
                           back: Iterable[str]) -> tuple[list[str], list[str]]:
        """Start the missing clock of nodes just seen without a heartbeat; stop it for those back.
        Returns (the nodes whose clock this call started, those whose clock it stopped): of several
        control workers noticing the same node, exactly one is told (HSETNX, HDEL), and announces it."""
        back, first = list(back), list(first_missing.items())
        pipe = self.r.pipeline(transaction=False)
        for n in back:
            pipe.hdel(keys.NODES_MISSING_SINCE, n)
        for n, t in first:
            pipe.hsetnx(keys.NODES_MISSING_SINCE, n, repr(t))
        done = pipe.execute()
        stopped = [n for n, ok in zip(back, done) if ok]
        started = [n for (n, _t), ok in zip(first, done[len(back):]) if ok]
        return started, stopped

    def known_nodes(self) -> set[str]:
        return set(self.r.smembers(keys.NODES))

    def live_nodes(self) -> dict[str, NodeInfo]:
        names = sorted(self.known_nodes())
        pipe = self.r.pipeline(transaction=False)
        queue_heartbeats(pipe, names)
        return take_live(names, iter(pipe.execute()))

    def node_admin(self, name: str) -> NodeAdmin:
        return _admin(self.r.hgetall(keys.node_admin(name)))

    def all_node_admin(self, names: Iterable[str]) -> dict[str, NodeAdmin]:
        names = list(names)
        pipe = self.r.pipeline(transaction=False)
        queue_admin(pipe, names)
        return take_admin(names, iter(pipe.execute()))

    def set_node_admin(self, name: str, **flags: bool) -> None:
        """The operator's cordon/drain flags; confirmed on the replicas `durability` asks for (a cordon
        a failover forgot would let placement use the node again)."""
        mapping = {k: "1" if v else "0" for k, v in flags.items()}
        self.durably(f"node {name}'s flags", lambda r: r.hset(keys.node_admin(name), mapping=mapping))
