"""`llmgw engines rotate-credentials [MODEL]`: new engine credentials by the normal rolling update.

Every replica's engine has its own secret (docs/engines.md). Rotating marks the model's replicas (or
every model's) outdated; reconcile then replaces them as it replaces any outdated replica: a new one,
with a fresh secret, becomes Ready, then an old one drains and stops. No engine restarts out of band.
"""

from __future__ import annotations

import time

from llmgw.catalog import read_applied
from llmgw.cli.common import kick, replicated, settings, store
from llmgw.errors import LlmgwError, NotFound
from llmgw.state.kicks import RECONCILE


def register(sub) -> None:
    p = sub.add_parser("engines", help="engine credentials")
    es = p.add_subparsers(dest="engines_command", metavar="ACTION", required=True)
    r = es.add_parser("rotate-credentials", help="replace the replicas of MODEL (default: every model) by a "
                                                 "rolling update, each with a fresh engine credential")
    r.add_argument("model", nargs="?", metavar="MODEL", help="a model name or alias of the applied catalog")
    r.set_defaults(func=cmd_rotate)


def cmd_rotate(args) -> int:
    cfg = settings()
    s = store(cfg)
    _version, catalog, _meta = read_applied(s)
    if catalog is None:
        raise LlmgwError("no catalog applied: there are no engines to rotate")
    name = None
    if args.model:
        model = catalog.resolve(args.model)
        if model is None:
            raise NotFound("model in the applied catalog", args.model)
        name = model.name
    # Counted before the rotation: the reconcile it kicks may add the first replacement at once.
    live = [r for r in s.all_replicas() if r.stop_requested_at is None and (name is None or r.model == name)]
    generation = replicated(lambda: s.rotate_credentials(name))
    s.emit("credentials_rotated", f"llmgw engines rotate-credentials {name or '(all models)'}", source="cli",
           model=name or "", generation=generation, ts=time.time())
    kick(cfg, s, RECONCILE)
    print(f"engine credentials of {name or 'every model'} rotated: {len(live)} replica(s) will be replaced by a "
          "rolling update, each with a fresh secret (watch with `llmgw status`)")
    return 0
