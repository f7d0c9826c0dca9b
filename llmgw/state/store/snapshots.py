"""Reads that span aggregates: what one control pass decides on, in one call of two pipelined round
trips (the id sets and the small hashes first, then everything they name; the reconcile pass's
replica loads take a third, as they are named by records only the second brings); and the
housekeeping pass's one write, which spans aggregates too. Each aggregate
module queues its own commands and decodes its own replies (`queue_*`, `take_*`), so the keys stay
theirs. The views are plain data (`llmgw.state.views`)."""

from __future__ import annotations

from typing import Iterable, Mapping, NamedTuple

from llmgw.state.records import ReplicaRecord
from llmgw.state.store import (
    adapters,
    autoscale,
    catalog,
    credentials,
    endpoints,
    externals,
    gateways,
    loads,
    nodes,
    replicas,
    weights,
)
from llmgw.state.store.base import Aggregate
from llmgw.state.views import DemandReads, DemandView, FleetView, HousekeepingView, PublishView


class Tidied(NamedTuple):
    """What `write_housekeeping` changed: the load samples it deleted, the nodes whose missing clock
    it started (lost) and stopped (returned)."""

    stale_loads: int
    lost: tuple[str, ...]
    returned: tuple[str, ...]


class Snapshots(Aggregate):
    def fleet_view(self, reads: DemandReads = DemandReads()) -> FleetView:
        """The fleet, the autoscaler's records and the last adapter rows, and the demand `reads`
        names. Ids whose record or report is gone are tidied from their sets."""
        histories = dict(reads.histories)
        pipe = self.r.pipeline(transaction=False)
        nodes.queue_names(pipe)
        replicas.queue_ids(pipe)
        nodes.queue_last_seen(pipe)
        credentials.queue_generations(pipe)
        weights.queue_sources(pipe)
        autoscale.queue_states(pipe)
        adapters.queue_rows(pipe)
        autoscale.queue_histories(pipe, histories)
        autoscale.queue_hints(pipe, reads.hints)
        if reads.gateways:
            gateways.queue_ids(pipe)
        replies = iter(pipe.execute())
        names, rids = sorted(next(replies)), sorted(next(replies))
        last_seen, creds = nodes.take_last_seen(replies), credentials.take_generations(replies)
        sources = sorted(next(replies))
        states, placed = autoscale.take_states(replies), adapters.take_rows(replies)
        samples = autoscale.take_histories(histories, replies)
        hints = autoscale.take_hints(reads.hints, replies)
        gids = sorted(next(replies)) if reads.gateways else []

        pipe = self.r.pipeline(transaction=False)
        nodes.queue_heartbeats(pipe, names)
        replicas.queue_records(pipe, rids)
        nodes.queue_admin(pipe, names)
        weights.queue_facts(pipe, sources)
        gateways.queue_reports(pipe, gids)
        replies = iter(pipe.execute())
        live = nodes.take_live(names, replies)
        recs, stale = replicas.take_records(rids, replies)
        admin = nodes.take_admin(names, replies)
        facts, expired = weights.take_facts(sources, replies)
        reports, gone = gateways.take_reports(gids, replies)
        self.tidy_replica_ids(stale)  # type: ignore[attr-defined]
        self.tidy_weights_sources(expired)  # type: ignore[attr-defined]
        self.tidy_gateway_ids(gone)  # type: ignore[attr-defined]

        scraped = {}
        lids = [r.id for r in recs if (r.model, r.profile) in reads.loads]
        if lids:
            pipe = self.r.pipeline(transaction=False)
            loads.queue_loads(pipe, lids)
            scraped = loads.take_loads(lids, iter(pipe.execute()))
        demand = DemandView(tuple(reports), scraped, hints, states,
                            {key: tuple(found) for key, found in samples.items()}, placed)
        return FleetView(frozenset(names), live, tuple(recs), admin, last_seen, creds, facts, demand)

    def publish_view(self) -> PublishView:
        """Ids whose record or report is gone are tidied from their sets, as `all_replicas` and
        `gateway_reports` do."""
        pipe = self.r.pipeline(transaction=False)
        catalog.queue_document(pipe)
        replicas.queue_ids(pipe)
        nodes.queue_names(pipe)
        nodes.queue_last_seen(pipe)
        gateways.queue_ids(pipe)
        externals.queue_ids(pipe)
        endpoints.queue_published(pipe)
        replies = iter(pipe.execute())
        doc = catalog.take_document(replies)
        rids, names = sorted(next(replies)), sorted(next(replies))
        last_seen = nodes.take_last_seen(replies)
        gids, xids = sorted(next(replies)), sorted(next(replies))
        version, fingerprint = endpoints.take_published_stamp(replies)

        pipe = self.r.pipeline(transaction=False)
        replicas.queue_records(pipe, rids)
        nodes.queue_heartbeats(pipe, names)
        gateways.queue_reports(pipe, gids)
        externals.queue_records(pipe, xids)
        replies = iter(pipe.execute())
        recs, stale = replicas.take_records(rids, replies)
        live = nodes.take_live(names, replies)
        reports, gone = gateways.take_reports(gids, replies)
        ext = externals.take_records(xids, replies)
        self.tidy_replica_ids(stale)  # type: ignore[attr-defined]
        self.tidy_gateway_ids(gone)  # type: ignore[attr-defined]
        return PublishView(doc, tuple(recs), live, last_seen, tuple(reports), tuple(ext), version, fingerprint)

    def housekeeping_view(self) -> HousekeepingView:
        """Ids whose record is gone are tidied from the replica set, as `all_replicas` does."""
        pipe = self.r.pipeline(transaction=False)
        replicas.queue_ids(pipe)
        externals.queue_ids(pipe)
        nodes.queue_names(pipe)
        nodes.queue_missing_since(pipe)
        nodes.queue_last_seen(pipe)
        replies = iter(pipe.execute())
        rids, xids, names = sorted(next(replies)), sorted(next(replies)), sorted(next(replies))
        missing_since, last_seen = nodes.take_missing_since(replies), nodes.take_last_seen(replies)

        pipe = self.r.pipeline(transaction=False)
        replicas.queue_records(pipe, rids)
        externals.queue_records(pipe, xids)
        nodes.queue_heartbeats(pipe, names)
        nodes.queue_admin(pipe, names)
        replies = iter(pipe.execute())
        recs, stale = replicas.take_records(rids, replies)
        ext = externals.take_records(xids, replies)
        live = nodes.take_live(names, replies)
        admin = nodes.take_admin(names, replies)
        self.tidy_replica_ids(stale)  # type: ignore[attr-defined]
        return HousekeepingView(tuple(recs), tuple(ext), frozenset(names), live, admin, missing_since, last_seen)

    def write_housekeeping(self, keep_loads: Iterable[str], records: Iterable[ReplicaRecord],
                           forget: Iterable[str], first_missing: Mapping[str, float],
                           back: Iterable[str]) -> Tidied:
        """What one housekeeping pass decided: delete the load samples of ids not in `keep_loads`,
        make the per-node replica index agree with `records` (every record, as just read), drop
        every trace of the nodes to `forget`, start the missing clock of `first_missing` and stop it
        for those `back`."""
        stale = self.delete_loads_except(keep_loads)  # type: ignore[attr-defined]
        self.reindex_replica_nodes(records)  # type: ignore[attr-defined]
        self.forget_nodes(forget)  # type: ignore[attr-defined]
        lost, returned = self.note_missing_nodes(first_missing, back)  # type: ignore[attr-defined]
        return Tidied(stale, tuple(lost), tuple(returned))
