"""Node-queue tasks: `llmgw.launch` and `llmgw.stop`.

Both are short and idempotent: they check that the record exists and is on this node, and push its id
on the agent's wake list so the loop acts at once. The control plane already recorded the intent (the
record, or its `stop_requested_at`) before sending them, and the loop converges on that record, so a
lost, duplicated or redelivered task does no harm.
"""

from __future__ import annotations

import logging

from celery import shared_task

from workers.store_cache import STORES, StoreCache

log = logging.getLogger("llmgw.agent")


def _nudge(replica_id: str, what: str, stores: StoreCache = STORES) -> str:
    from celery import current_app

    settings = current_app.settings
    store = stores.get(settings.redis_url, settings.durability)
    rec = store.get_replica(replica_id)
    node = settings.node_name
    if rec is None:
        log.info("%s %s: no such replica record; nothing to do", what, replica_id)
        return "unknown"
    if node not in rec.all_nodes:
        log.warning("%s %s: the replica is placed on %s, not on %s; ignored", what, replica_id, rec.node, node)
        return "elsewhere"
    store.wake_agent(node, replica_id)
    return "woken"


@shared_task(name="llmgw.launch")
def launch(replica_id: str) -> str:
    return _nudge(replica_id, "launch")


@shared_task(name="llmgw.stop")
def stop(replica_id: str) -> str:
    return _nudge(replica_id, "stop")
