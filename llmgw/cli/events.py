"""`llmgw events [-f] [--model M] [--node N] [--kind K] [--since 10m] [-n N] [--json]`: the event history.

What happened to the fleet, oldest first (`llmgw.state.events`; docs/events.md lists the kinds): the
last `-n` events, or every event since `--since`, filtered by model, node and kind; `-f` then keeps
printing new ones as they are appended. `--json` prints one JSON object per line.
"""

from __future__ import annotations

import json
import re
import sys
import time
from datetime import datetime, timezone

from llmgw.cli.common import settings, store
from llmgw.state import events
from llmgw.state.store import Store

POLL = 0.5  # seconds between reads while following
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def register(sub) -> None:
    p = sub.add_parser("events", help="what happened to the fleet: placements, exits, restarts, applies ...")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new events (Ctrl-C stops)")
    p.add_argument("--model", help="only events about this model")
    p.add_argument("--node", help="only events about this node")
    p.add_argument("--kind", help="only this kind (e.g. replica_failed), or a prefix ending in * (replica_*)")
    p.add_argument("--since", help="every event of this last while: 30s, 10m, 2h, 1d (default: the last -n)")
    p.add_argument("-n", type=int, default=20, metavar="N", help="how many of the newest events (default 20)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.set_defaults(func=cmd_events)


def parse_duration(text: str) -> float:
    """Seconds in `30s`, `10m`, `2h`, `1d` or a plain number of seconds; ValueError says what is wrong."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text or "")
    if not m:
        raise ValueError(f"expected a duration like 30s, 10m, 2h or 1d, got {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


def when(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def line(e: events.Event) -> str:
    """One event for a human: time, kind, what it is about, what happened."""
    about = "/".join(x for x in (e.model, e.profile) if x)
    if e.replica:
        about = f"{about} {e.replica}".strip()
    if e.node:
        about = f"{about} on {e.node}" if about else f"node {e.node}"
    text = f"{about}: {e.message}" if about and e.message else (about or e.message)
    return f"{when(e.ts)}  {e.kind:<19}  {text}".rstrip()


def cmd_events(args) -> int:
    problems = []
    since = None
    if args.since is not None:
        try:
            since = parse_duration(args.since)
        except ValueError as e:
            problems.append(f"--since: {e}")
    if (p := events.kind_problem(args.kind)) is not None:
        problems.append(f"--kind: {p}")
    if args.n < 1:
        problems.append(f"-n: must be at least 1, got {args.n}")
    if problems:
        for p in problems:
            print(f"llmgw: {p}", file=sys.stderr)
        return 2
    s = store(settings())
    filters = {"model": args.model, "node": args.node, "kind": args.kind}
    if since is None:
        shown = s.latest_events(args.n, **filters)
    else:
        shown = _since(s, time.time() - since, filters)
    last = shown[-1].id if shown else _newest_id(s)
    for e in shown:
        _print(e, args.json)
    while args.follow:
        time.sleep(POLL)
        batch = s.read_events(after=last) if last else s.read_events()
        if batch:
            last = batch[-1].id
        for e in events.matching(batch, **filters):
            _print(e, args.json)
    return 0


# The stream's ids are Redis' clock at append time, an event's `ts` its writer's: seek a little early,
# then keep the events whose own time is in the while.
SEEK_MARGIN = 60.0


def _since(s: Store, t: float, filters: dict) -> list[events.Event]:
    out: list[events.Event] = []
    batch = s.read_events(since=t - SEEK_MARGIN)
    while batch:
        out += [e for e in events.matching(batch, **filters) if e.ts >= t]
        batch = s.read_events(after=batch[-1].id)
    return out


def _newest_id(s: Store) -> str | None:
    """Where following starts when nothing was shown: after the newest event, whatever it is."""
    newest = s.latest_events(1)
    return newest[-1].id if newest else None


def _print(e: events.Event, as_json: bool) -> None:
    print(json.dumps(e.to_dict(), sort_keys=True) if as_json else line(e), flush=True)
