"""The publish pass's shell: under the publish lock, one read (`Store.publish_view`), one decision
(`publish.decide`), one write (`Store.write_publish`); then, when the live nodes changed, a kicked
reconcile and the nodes' missing clock (`housekeeping_pass.note_nodes`)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

from llmgw.state import keys
from llmgw.state.kicks import PUBLISH, RECONCILE, Kicker, disabled
from llmgw.state.store import Store
from workers.control.external import external_endpoints
from workers.control.housekeeping_pass import note_nodes
from workers.control.publish import LOST_GRACE, decide
from workers.control.snapshot import CatalogKeeper

log = logging.getLogger("llmgw.control")


@dataclass
class PublishMemory:
    """What one control worker process remembers between publish passes."""

    live: frozenset[str] | None = None  # the live nodes at the last pass


def publish_once(
    store: Store, now: Callable[[], float], lock_ttl: float = 10.0, catalogs: CatalogKeeper | None = None,
    kicker: Kicker | None = None, memory: PublishMemory | None = None, lost_grace: float | None = None,
) -> int | None:
    """Publish the routable endpoints if they changed (`publish.decide`, over one `Store.publish_view`,
    written by one `Store.write_publish`). Returns the new version, else None (also when no readable
    catalog was ever seen: the published list then stays as it is).

    The write also stamps `unpublished_version` on every replica asked to stop that the list no longer
    holds: its agent drains it once every gateway has loaded that version. And when the set of live
    nodes changed since this process's last pass (a node joined or was lost), it kicks a reconcile."""
    kicker = kicker or disabled()
    began = time.monotonic()
    with store.lock(keys.PUBLISH_LOCK, lock_ttl) as held:
        if not held:
            kicker.mark_dirty(PUBLISH)
            return None
        kicker.started(PUBLISH)
        version = None
        try:
            view = store.publish_view()
            loaded = (catalogs or CatalogKeeper()).accept(view.catalog)
            if loaded is None:
                return None
            catalog_version, catalog = loaded
            t = now()
            d = decide(catalog, catalog_version, view, t, external_endpoints(catalog, view.externals),
                       memory.live if memory is not None else None,
                       LOST_GRACE if lost_grace is None else lost_grace)
            current = store.write_publish(d.endpoints if d.changed else None, d.fingerprint, d.unpublish,
                                          view.version, t)
            if d.changed:
                version = current
                log.info("published %d endpoints as version %d", len(d.endpoints), version)
            if memory is not None:
                memory.live = d.live
            if d.nodes_changed:
                kicker.kick(RECONCILE)  # a node joined or went quiet: place or replace now
                # Housekeeping would notice too, up to its interval later.
                note_nodes(store, {n: t for n in d.lost}, d.returned, view.last_seen, t)
            return version
        finally:
            kicker.finished(PUBLISH)
            store.count_pass("publish", time.monotonic() - began, 1 if version else 0)
