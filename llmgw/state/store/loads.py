"""Load samples: each replica's (and external url's) last scrape, a JSON value with a TTL."""

from __future__ import annotations

import json
from typing import Iterable, Iterator, Sequence

from llmgw.state import keys
from llmgw.state.records import LoadRecord
from llmgw.state.store.base import Aggregate, Pipeline, ms


def queue_loads(pipe: Pipeline, ids: Sequence[str]) -> None:
    if ids:
        pipe.mget([keys.load(i) for i in ids])


def take_loads(ids: Sequence[str], replies: Iterator) -> dict[str, LoadRecord]:
    """The last scrape of each of `ids` that has one."""
    return {i: LoadRecord.from_dict(json.loads(v)) for i, v in zip(ids, next(replies) if ids else []) if v}


class Loads(Aggregate):
    def write_load(self, rec: LoadRecord, ttl: float = 30.0) -> None:
        self.r.set(keys.load(rec.replica_id), json.dumps(rec.to_dict()), px=ms(ttl))

    def delete_loads_except(self, replica_ids: Iterable[str]) -> int:
        """Drop the load samples of replicas not in `replica_ids` (deleted ones); returns how many."""
        keep, prefix = set(replica_ids), keys.load("")
        stale = [k for k in self.r.scan_iter(match=prefix + "*", count=500) if k[len(prefix):] not in keep]
        if stale:
            self.r.delete(*stale)
        return len(stale)

    def loads(self, replica_ids: Iterable[str]) -> dict[str, LoadRecord]:
        ids = list(replica_ids)
        if not ids:
            return {}
        return take_loads(ids, iter([self.r.mget([keys.load(i) for i in ids])]))
