"""The endpoint list the gateways route by: one JSON document {version, fingerprint, published_at,
endpoints}, its version (a counter, bumped in the same MULTI), and a pub/sub hint when it moves."""

from __future__ import annotations

import json
from typing import Iterable, Iterator, NamedTuple, Sequence

import redis

from llmgw.state import keys
from llmgw.state.events import published_message
from llmgw.state.records import EndpointInfo
from llmgw.state.store.base import Aggregate, Pipeline
from llmgw.state.store.events import queue_event
from llmgw.state.store.replicas import queue_update


def queue_published(pipe: Pipeline) -> None:
    pipe.get(keys.ENDPOINTS)


def take_published_stamp(replies: Iterator) -> tuple[int, str]:
    """(version, fingerprint) of the published list, without decoding its endpoints."""
    raw = next(replies)
    if not raw:
        return 0, ""
    doc = json.loads(raw)
    return int(doc.get("version", 0)), doc.get("fingerprint", "")


class PublishedEndpoints(NamedTuple):
    """The endpoint list as last published (version 0, no fingerprint and no endpoints: never)."""

    version: int
    fingerprint: str  # of the list and the catalog version (`workers.control.publish.fingerprint`)
    endpoints: list[EndpointInfo]


class Endpoints(Aggregate):
    def endpoints_version(self) -> int:
        return int(self.r.get(keys.ENDPOINTS_VERSION) or 0)

    def read_endpoints(self) -> PublishedEndpoints:
        """The endpoint list as last published."""
        raw = self.r.get(keys.ENDPOINTS)
        if not raw:
            return PublishedEndpoints(0, "", [])
        doc = json.loads(raw)
        return PublishedEndpoints(
            int(doc.get("version", 0)),
            doc.get("fingerprint", ""),
            [EndpointInfo.from_dict(e) for e in doc.get("endpoints", [])],
        )

    def write_endpoints(self, endpoints: Sequence[EndpointInfo], fingerprint: str, now: float) -> int:
        """Publish a new list: bump the version, write the list and send the hint in one MULTI."""
        return self._write_list(list(endpoints), fingerprint, now, (), announce=False)

    def write_publish(self, endpoints: Sequence[EndpointInfo] | None, fingerprint: str,
                      unpublished: Iterable[str], version: int, now: float) -> int:
        """The publish pass's one write: with `endpoints`, the list as the next version with its
        `endpoints_published` event and the hint; and `unpublished_version` on each replica of
        `unpublished` (asked to stop, no longer listed) set to the version in force (the new one, else
        `version`), which is returned. One MULTI when the list changes, one pipeline otherwise."""
        stamp = list(unpublished)
        if endpoints is not None:
            return self._write_list(list(endpoints), fingerprint, now, stamp, announce=True)
        if stamp:
            pipe = self.r.pipeline(transaction=False)
            for rid in stamp:
                queue_update(pipe, rid, {"unpublished_version": version})
            pipe.execute()
        return version

    def _write_list(self, eps: list[EndpointInfo], fingerprint: str, now: float, stamp: list[str],
                    announce: bool) -> int:
        def txn(pipe: Pipeline) -> int:
            new = int(pipe.get(keys.ENDPOINTS_VERSION) or 0) + 1
            doc = {"version": new, "fingerprint": fingerprint, "published_at": now,
                   "endpoints": [e.to_dict() for e in eps]}
            pipe.multi()
            pipe.set(keys.ENDPOINTS, json.dumps(doc))
            pipe.set(keys.ENDPOINTS_VERSION, new)
            for rid in stamp:
                queue_update(pipe, rid, {"unpublished_version": new})
            if announce:
                queue_event(pipe, "endpoints_published", published_message(len(eps)), source="control", ts=now,
                            version=new, count=len(eps))
            pipe.publish(keys.ENDPOINTS_CHANNEL, str(new))
            return new

        return self.r.transaction(txn, keys.ENDPOINTS_VERSION, value_from_callable=True)

    def subscribe_endpoints(self) -> redis.client.PubSub:
        """A subscription to the hint that a new endpoint list was published (close it when done)."""
        ps = self.r.pubsub(ignore_subscribe_messages=True)
        ps.subscribe(keys.ENDPOINTS_CHANNEL)
        return ps
