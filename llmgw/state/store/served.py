"""How the gateways served the requests that asked to be explained (llmgw.state.served): one JSON
string per request id, with a TTL, written in one pipeline per gateway flush."""

from __future__ import annotations

import logging
from typing import Iterable

from llmgw.state import keys
from llmgw.state.served import Served
from llmgw.state.store.base import Aggregate

log = logging.getLogger("llmgw.state.store.served")


class ServedRequests(Aggregate):
    def add_served(self, records: Iterable[Served], keep: float) -> None:
        """Write a gateway's finished records, each kept `keep` seconds."""
        pipe = self.r.pipeline(transaction=False)
        for rec in records:
            pipe.set(keys.served(rec.id), rec.to_json(), ex=max(1, int(keep)))
        pipe.execute()

    def served(self, request_id: str) -> Served | None:
        """The record of one request, None when there is none (never asked, expired, or malformed)."""
        blob = self.r.get(keys.served(request_id))
        if blob is None:
            return None
        try:
            return Served.from_json(blob)
        except ValueError as e:
            log.error("ignoring malformed %s: %s", keys.served(request_id), e)
            return None
