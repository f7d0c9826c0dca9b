"""`llmgw node cordon|uncordon|drain NAME`: operator intent for a node, kept in Redis without a TTL.

cordon: nothing new is placed there; what runs stays. drain: cordon, and the control plane moves its
replicas elsewhere (a new one Ready first, then the old one stops). uncordon: clears both.
"""

from __future__ import annotations

import sys

from llmgw.cli.common import kick, replicated, settings, store
from llmgw.state.kicks import RECONCILE


def register(sub) -> None:
    p = sub.add_parser("node", help="cordon, uncordon or drain a node")
    nsub = p.add_subparsers(dest="node_command", metavar="SUBCOMMAND", required=True)
    for name, text in (
        ("cordon", "place nothing new on NAME; running replicas stay"),
        ("uncordon", "make NAME schedulable again (also ends a drain)"),
        ("drain", "move every replica off NAME (new one Ready first), and place nothing new there"),
    ):
        c = nsub.add_parser(name, help=text, description=text)
        c.add_argument("name", metavar="NAME")
        c.set_defaults(func=cmd_admin, action=name)


FLAGS = {
    "cordon": {"cordoned": True},
    "uncordon": {"cordoned": False, "draining": False},
    "drain": {"cordoned": True, "draining": True},
}


def cmd_admin(args) -> int:
    cfg = settings()
    s = store(cfg)
    known = s.known_nodes() | set(s.live_nodes())
    if args.name not in known:
        listing = ", ".join(sorted(known)) or "none has sent a heartbeat yet"
        print(f"llmgw: no node named {args.name!r} (known nodes: {listing})", file=sys.stderr)
        return 2
    replicated(lambda: s.set_node_admin(args.name, **FLAGS[args.action]))
    s.emit({"cordon": "node_cordoned", "uncordon": "node_uncordoned", "drain": "node_drained"}[args.action],
                f"llmgw node {args.action}", source="cli", node=args.name)
    kick(cfg, s, RECONCILE)
    on_it = [r for r in s.replicas_on(args.name) if r.stop_requested_at is None]
    if args.action == "drain":
        print(f"node {args.name}: draining; {len(on_it)} replica(s) will move elsewhere "
              "(watch with `llmgw status`)")
    elif args.action == "cordon":
        print(f"node {args.name}: cordoned; nothing new will be placed there ({len(on_it)} replica(s) stay)")
    else:
        print(f"node {args.name}: schedulable")
    return 0
