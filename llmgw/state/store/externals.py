"""External servers (`engine: external`): one record of facts per url (its last check, failures in a
row, last success) and the set of their ids."""

from __future__ import annotations

import json
from typing import Iterable, Iterator, Sequence

from llmgw.state import keys
from llmgw.state.records import ExternalRecord
from llmgw.state.store.base import Aggregate, Pipeline, decoded


def queue_ids(pipe: Pipeline) -> None:
    pipe.smembers(keys.EXTERNALS)


def queue_records(pipe: Pipeline, ids: Sequence[str]) -> None:
    if ids:
        pipe.mget([keys.external(i) for i in ids])


def take_records(ids: Sequence[str], replies: Iterator) -> list[ExternalRecord]:
    """The readable records of `ids` (one from a newer or broken writer is checked afresh, never fatal)."""
    return decoded(next(replies) if ids else [], ExternalRecord.from_dict)


class Externals(Aggregate):
    def write_externals(self, records: Iterable[ExternalRecord]) -> None:
        pipe = self.r.pipeline(transaction=False)
        for rec in records:
            pipe.set(keys.external(rec.id), json.dumps(rec.to_dict()))
            pipe.sadd(keys.EXTERNALS, rec.id)
        pipe.execute()

    def external_records(self) -> list[ExternalRecord]:
        ids = sorted(self.r.smembers(keys.EXTERNALS))
        pipe = self.r.pipeline(transaction=False)
        queue_records(pipe, ids)
        return take_records(ids, iter(pipe.execute()))

    def delete_externals(self, ids: Iterable[str]) -> None:
        """Forget external urls that left the catalog: their records and load samples."""
        ids = list(ids)
        if ids:
            pipe = self.r.pipeline(transaction=False)
            pipe.delete(*[keys.external(i) for i in ids], *[keys.load(i) for i in ids])
            pipe.srem(keys.EXTERNALS, *ids)
            pipe.execute()
