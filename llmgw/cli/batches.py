"""`llmgw batches [list|show|cancel]`: the Batch API's batches, every key's, with their progress and
rate (docs/batch.md). A thin shell over the store and `llmgw.batch.view`."""

from __future__ import annotations

import os
import time

from llmgw.batch import kick
from llmgw.batch.config import BatchSettings
from llmgw.batch.shapes import batch_object
from llmgw.batch.view import batch_row
from llmgw.cli import common
from llmgw.errors import NotFound
from llmgw.state.kicks import broker_app


def register(sub) -> None:
    p = sub.add_parser("batches", help="Batch API batches: progress, rate, cancel")
    bs = p.add_subparsers(dest="batches_command", metavar="ACTION")
    ls = bs.add_parser("list", help="the batches, newest first (the default action)")
    _list_flags(ls)
    ls.set_defaults(func=_list)
    sh = bs.add_parser("show", help="one batch as the API answers it (JSON)")
    sh.add_argument("id")
    sh.set_defaults(func=_show)
    cn = bs.add_parser("cancel", help="stop sending a batch's lines; the answered ones are kept")
    cn.add_argument("id")
    cn.set_defaults(func=_cancel)
    _list_flags(p)
    p.set_defaults(func=_list)


def _list_flags(p) -> None:
    p.add_argument("--json", action="store_true")
    p.add_argument("--active", action="store_true", help="only those not ended")
    p.add_argument("--limit", type=int, default=50, help="at most this many (default 50)")


def rows(store, now: float, active: bool = False, limit: int = 50) -> list[dict]:
    owners = store.key_names()
    found = store.batches(store.active_batch_ids()) if active else store.list_batches(None, limit=limit)
    return [batch_row(b, owners, now) for b in sorted(found, key=lambda b: -b.created_at)[:limit]]


def _list(args) -> int:
    from llmgw.cli.keys import checked_store

    got = rows(checked_store(), time.time(), getattr(args, "active", False), getattr(args, "limit", 50))
    if getattr(args, "json", False):
        common.print_json(got)
        return 0
    if not got:
        print("no batches")
        return 0
    print(f"{'ID':32} {'OWNER':16} {'MODEL':16} {'STATUS':11} {'DONE':>13} {'FAILED':>7} {'RATE/s':>7} {'ETA':>7}")
    for r in got:
        done = f"{r['done']}/{r['total']}"
        pct = f"{r['progress'] * 100:.0f}%"
        rate = f"{r['rate']:.1f}" if r["rate"] is not None else "-"
        eta = _age(r["eta_seconds"]) if r["eta_seconds"] is not None else "-"
        print(f"{r['id']:32} {r['owner'][:16]:16} {r['model'][:16]:16} {r['status']:11} {done + ' ' + pct:>13} "
              f"{r['failed']:>7} {rate:>7} {eta:>7}")
    return 0


def _age(seconds: float) -> str:
    s = int(seconds)
    return f"{s}s" if s < 120 else f"{s // 60}m" if s < 7200 else f"{s // 3600}h"


def _find(store, batch_id: str):
    b = store.batch(batch_id)
    if b is None:
        raise NotFound("batch", batch_id)
    return b


def _show(args) -> int:
    from llmgw.cli.keys import checked_store

    common.print_json(batch_object(_find(checked_store(), args.id)))
    return 0


def _cancel(args) -> int:
    from llmgw.cli.keys import checked_store

    store = checked_store()
    b = _find(store, args.id)
    if b.ended:
        print(f"batch {b.id} is {b.status}: nothing to cancel")
        return 1
    if b.cancelling_at is None:
        store.update_batch(b.id, cancelling_at=time.time())
    s = BatchSettings.from_env({**os.environ, "LLMGW_REDIS_URL": common.settings().redis_url})
    kick.send_run(store, kick.celery_run_sender(broker_app(s.redis_url)), b.id, kick.queued_ttl(s.slice_seconds))
    print(f"cancelling batch {b.id}: no more lines are sent (within LLMGW_BATCH_VIEW_INTERVAL); the answered ones "
          "stay in its output file")
    return 0
