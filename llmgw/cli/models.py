"""`llmgw models pull MODEL [--profile P] [--node N]` and `llmgw models ls`: the nodes' weights caches.

pull: asks node agents to download a model's remote source before any replica needs it (every live
node its profile may be placed on, or the one named), and shows each download until it is complete
or failed. ls: what each node holds, from its heartbeat (source, size, last used), and its room.
`targets`, `pull_lines` and `cache_report` are pure; the commands read, call them, and print.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Mapping

from llmgw.catalog import Catalog, read_applied
from llmgw.cli.common import print_json, settings, store
from llmgw.cli.status import _age, _table
from llmgw.engines import get_engine
from llmgw.gpus import normalize_gpu_class
from llmgw.state.node_records import NodeInfo
from llmgw.state.weights import PullStatus
from llmgw.weights.cache import gib
from llmgw.weights.errors import SourceInvalid
from llmgw.weights.sources import REMOTE, parse_source


def register(sub) -> None:
    p = sub.add_parser("models", help="pre-pull model weights onto nodes; list each node's weights cache")
    msub = p.add_subparsers(dest="models_command", metavar="SUBCOMMAND", required=True)
    pull = msub.add_parser("pull", help="download a model's weights onto the nodes it may be placed on",
                           description="download a model's weights (its hf:// or https:// source) onto the "
                                       "nodes its profiles may be placed on, or onto --node")
    pull.add_argument("model", metavar="MODEL", help="a model name or alias of the applied catalog")
    pull.add_argument("--profile", help="only this profile's source (default: every profile's)")
    pull.add_argument("--node", help="only this node")
    pull.add_argument("--no-wait", action="store_true", help="ask the nodes and return")
    pull.set_defaults(func=cmd_pull)
    ls = msub.add_parser("ls", help="the weights each node holds (from its heartbeat)")
    ls.add_argument("--json", action="store_true", help="print the report as JSON")
    ls.set_defaults(func=cmd_ls)


@dataclass(frozen=True)
class Target:
    node: str
    source: str
    layout: str


def targets(catalog: Catalog | None, name: str, profile: str | None, nodes: Mapping[str, NodeInfo],
            node: str | None) -> tuple[list[Target], str | None]:
    """What to pull where, or why nothing can be: each remote source of the model's profiles (or of
    `profile`), on `node` or on every live node of the profile's pool that matches its selector and
    has its GPU class."""
    model = catalog.resolve(name) if catalog else None
    if model is None:
        known = ", ".join(m.name for m in catalog.models) if catalog and catalog.models else "none"
        return [], f"{name} is not a model or alias of the applied catalog (models: {known})"
    profiles = [p for p in model.profiles if profile is None or p.name == profile]
    if not profiles:
        return [], f"model {model.name} has no profile {profile!r} (profiles: {', '.join(p.name for p in model.profiles)})"
    if node is not None and node not in nodes:
        return [], f"node {node!r} sends no heartbeat (live nodes: {', '.join(sorted(nodes)) or 'none'})"
    out: list[Target] = []
    for p in profiles:
        try:
            source = parse_source(model.source_for(p))
        except SourceInvalid:
            continue
        layout = get_engine(p.engine).weights_layout(str(source)) if isinstance(source, REMOTE) else None
        if not layout:
            continue
        cls = normalize_gpu_class(p.gpu.gpu_class) if p.gpu else None
        for n, info in sorted(nodes.items()):
            if node is not None:
                if n == node:
                    out.append(Target(n, str(source), layout))
                continue
            if info.pool != p.pool or any(info.labels.get(k) != v for k, v in p.node_selector.items()):
                continue
            if cls and not any(normalize_gpu_class(g.gpu_class) == cls for g in info.gpus):
                continue
            out.append(Target(n, str(source), layout))
    out = list(dict.fromkeys(out))
    if not out:
        where = f"node {node}" if node else "no live node its profiles may be placed on"
        sources = {model.source_for(p) for p in profiles}
        if not any(_remote(s) for s in sources):
            return [], (f"{model.name} has no hf:// or https:// source to pull ({', '.join(sorted(sources)) or 'none'}): "
                        "a local path or pkg: is on the node already")
        return [], f"nothing to pull for {model.name}: {where}"
    return out, None


def _remote(text: str) -> bool:
    try:
        return isinstance(parse_source(text), REMOTE)
    except SourceInvalid:
        return False


def pull_line(t: Target, st: PullStatus | None) -> str:
    """`a  hf://org/r  41% 3.2 of 7.8 GiB, 110.0 MiB/s, ETA 42s`."""
    if st is None:
        what = "asked; waiting for its node agent"
    elif st.phase == "failed":
        what = f"failed ({st.error_kind}): {st.error}"
    elif st.phase == "complete":
        what = f"complete, {gib(st.total or st.done)}"
    else:
        what = f"{st.phase} " + (f"{st.done / st.total:.0%} {gib(st.done)} of {gib(st.total)}" if st.total else gib(st.done))
        if st.rate:
            what += f", {gib(st.rate)}/s"
        if st.eta is not None:
            what += f", ETA {_age(st.eta)}"
    return f"{t.node}  {t.source}  {what}"


def cmd_pull(args) -> int:
    s = store(settings())
    _v, catalog, _m = read_applied(s)
    found, problem = targets(catalog, args.model, args.profile, s.live_nodes(), args.node)
    if problem:
        print(f"llmgw: {problem}", file=sys.stderr)
        return 2
    for t in found:
        s.request_pull(t.node, t.source, t.layout)
        print(f"{t.node}  {t.source}  asked")
    if args.no_wait:
        return 0
    shown: dict[Target, str] = {}
    while True:
        status = {n: s.pull_status(n) for n in {t.node for t in found}}
        states = {t: status[t.node].get(t.source) for t in found}
        for t, st in states.items():
            line = pull_line(t, st)
            if shown.get(t) != line:
                print(line, flush=True)
                shown[t] = line
        if all(st is not None and st.phase in ("complete", "failed") for st in states.values()):
            return 0 if all(st.phase == "complete" for st in states.values()) else 1
        time.sleep(0.5)


def cache_report(nodes: Mapping[str, NodeInfo], now: float) -> dict:
    """Each live node's cache: its entries, where, free, room and budget (JSON-able)."""
    return {"nodes": [{"node": n, "dir": info.weights_dir, "free": info.weights_free, "room": info.weights_room,
                       "budget": info.weights_budget,
                       "weights": [{"source": w.source, "size": w.size, "last_used": w.last_used,
                                    "last_used_age": now - w.last_used if w.last_used else None}
                                   for w in sorted(info.weights, key=lambda w: -w.last_used)]}
                      for n, info in sorted(nodes.items())]}


def render(report: dict) -> str:
    rows, heads = [], []
    for n in report["nodes"]:
        size = lambda v: "-" if v is None else gib(v)  # noqa: E731
        heads.append(f"{n['node']}: {size(n['free'])} free under {n['dir'] or '?'}, room for {size(n['room'])}"
                     + (f", budget {size(n['budget'])}" if n["budget"] else ""))
        for w in n["weights"]:
            age = "never" if w["last_used_age"] is None else _age(w["last_used_age"]) + " ago"
            rows.append([n["node"], w["source"], gib(w["size"]), age])
    table = _table(["NODE", "SOURCE", "SIZE", "LAST USED"], rows) if rows else "no node holds downloaded weights"
    return "\n".join([table, "", *heads]) if heads else "no node sends heartbeats"


def cmd_ls(args) -> int:
    report = cache_report(store(settings()).live_nodes(), time.time())
    if args.json:
        print_json(report)
    else:
        print(render(report))
    return 0
