"""Gateway reports: what each gateway process routes by and holds (a JSON value with a TTL, so a dead
process's report expires), and the set of their ids."""

from __future__ import annotations

import json
from typing import Iterator, Sequence

from llmgw.state import keys
from llmgw.state.demand_records import GatewayReport
from llmgw.state.store.base import Aggregate, Pipeline, compact, ms


def queue_ids(pipe: Pipeline) -> None:
    pipe.smembers(keys.GATEWAYS)


def queue_reports(pipe: Pipeline, ids: Sequence[str]) -> None:
    if ids:
        pipe.mget([keys.gateway_report(i) for i in ids])


def take_reports(ids: Sequence[str], replies: Iterator) -> tuple[list[GatewayReport], list[str]]:
    """The readable reports of `ids`, and the ids whose report has expired. A report from a newer or
    broken writer is ignored, never fatal to the reader."""
    out, gone = [], []
    for i, v in zip(ids, next(replies) if ids else []):
        if v is None:
            gone.append(i)
            continue
        try:
            out.append(GatewayReport.from_dict(json.loads(v)))
        except (ValueError, TypeError):
            continue
    return out, gone


class Gateways(Aggregate):
    def write_gateway_report(self, report: GatewayReport, ttl: float) -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.set(keys.gateway_report(report.id), compact(report.to_dict()), px=ms(ttl))
        pipe.sadd(keys.GATEWAYS, report.id)
        pipe.execute()

    def gateway_reports(self) -> list[GatewayReport]:
        """The reports of live gateway processes (a dead one's report has expired); expired ids are
        tidied from the set here."""
        ids = sorted(self.r.smembers(keys.GATEWAYS))
        pipe = self.r.pipeline(transaction=False)
        queue_reports(pipe, ids)
        out, gone = take_reports(ids, iter(pipe.execute()))
        self.tidy_gateway_ids(gone)
        return out

    def tidy_gateway_ids(self, gone: Sequence[str]) -> None:
        """Drop the ids of gateways whose report has expired (a reader found them)."""
        if gone:
            self.r.srem(keys.GATEWAYS, *gone)
