"""`llmgw catalog validate|apply|show|history`: check, diff, apply and inspect the model catalog.

`catalog show -o yaml` prints the applied catalog as a file to edit and apply again: the fields that
resolve to their value anyway left out (llmgw.catalog.compact), so applying it unchanged says
"unchanged".

Exit codes: 0 success; 1 the applied catalog changed while applying (compare-and-set lost; nothing
written); 2 an invalid catalog, an unreadable file or an unreachable Redis, or `show -o yaml` with no
catalog to print (an empty file applied would remove every model). Never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import datetime, timezone

from llmgw.catalog import (
    Catalog,
    apply_catalog,
    compact_yaml,
    diff_catalogs,
    format_diff,
    load_catalog_file,
    profile_spec_hash,
    read_applied,
    read_version,
)
from llmgw.cli.common import kick, print_json, replicated, settings, who
from llmgw.cli.progress import Progress, Ticker
from llmgw.errors import CatalogConflict, CatalogInvalid, RedisUnreachable
from llmgw.settings import Settings
from llmgw.state.kicks import RECONCILE
from llmgw import tracing
from llmgw.state.store import RedisError, Store, connect

EXIT_CONFLICT = 1
EXPORT_TIMEOUT = 2.0  # seconds the command's spans may take to export at exit (docs/tracing.md)
EXIT_INVALID = 2


def register(sub) -> None:
    p = sub.add_parser("catalog", help="validate, apply and inspect the model catalog")
    csub = p.add_subparsers(dest="catalog_command", metavar="SUBCOMMAND", required=True)

    v = csub.add_parser("validate", help="check a catalog file; exit 2 with one line per problem")
    v.add_argument("file")
    v.set_defaults(func=cmd_validate)

    a = csub.add_parser("apply", help="validate a catalog file, show the diff and store it as the next version")
    a.add_argument("file")
    a.add_argument("--dry-run", action="store_true", help="print the diff against the applied catalog only")
    a.add_argument("--wait", action="store_true",
                   help="return once every profile of the applied catalog has its replicas Ready and routable, "
                        "printing how long each took (exit 1 on timeout)")
    a.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                   help="with --wait: give up after this long (default 600)")
    a.set_defaults(func=cmd_apply)

    s = csub.add_parser("show", help="print the applied catalog")
    s.add_argument("-o", "--output", choices=("table", "yaml", "json"), default="table",
                   help="table (default); yaml: the catalog as a file to edit and apply again, defaults left "
                        "out; json: the stored document, every default spelled out")
    s.add_argument("--json", action="store_true", help="the same as -o json")
    s.add_argument("--version", type=int, default=None, metavar="N", help="a past version from the history")
    s.set_defaults(func=cmd_show)

    h = csub.add_parser("history", help="the last applied versions: who, when, hash")
    h.add_argument("-n", type=_positive, default=10, metavar="N", help="how many versions (default 10)")
    h.add_argument("--json", action="store_true")
    h.set_defaults(func=cmd_history)


def _load(path: str, applying: bool) -> Catalog | None:
    try:
        return load_catalog_file(path)
    except CatalogInvalid as e:
        for p in e.problems:
            print(f"{e.source}: {p}", file=sys.stderr)
        n = len(e.problems)
        tail = ", nothing applied" if applying else ""
        print(f"{e.source}: {n} problem{'s' if n != 1 else ''}{tail}", file=sys.stderr)
        return None


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return n


def _redis(s: Settings | None = None) -> Store:
    s = s or settings()
    url = s.redis_url
    store = Store(connect(url), s.durability)
    try:
        store.ping()
    except RedisError as e:
        raise RedisUnreachable(url, e, exit_code=EXIT_INVALID) from e
    return store


def _guard(fn):
    """Redis errors after connecting become one line and exit 2, never a traceback."""

    def run(args) -> int:
        try:
            return fn(args)
        except RedisError as e:
            print(f"llmgw: Redis error: {e}", file=sys.stderr)
            return EXIT_INVALID
        except CatalogInvalid as e:  # a stored document this release cannot read
            print(f"llmgw: {e}", file=sys.stderr)
            return EXIT_INVALID

    run.__name__ = fn.__name__
    return run


def _summary(cat: Catalog) -> str:
    n = len(cat.models)
    return f"{n} model{'s' if n != 1 else ''}, {len(cat.profiles())} profiles, {cat.total_replicas()} replicas"


def cmd_validate(args) -> int:
    cat = _load(args.file, applying=False)
    if cat is None:
        return EXIT_INVALID
    print(f"{args.file}: ok ({_summary(cat)}, hash {cat.hash()})")
    return 0


@_guard
def cmd_apply(args) -> int:
    cat = _load(args.file, applying=True)
    if cat is None:
        return EXIT_INVALID
    s = settings()
    r = _redis(s)
    version, current, _ = read_applied(r)
    diff = diff_catalogs(current, cat)
    if current is not None and current.hash() == cat.hash():
        print(f"unchanged: catalog version {version} already has this content (hash {cat.hash()})")
        return wait_ready(r, cat, args.timeout, time.monotonic()) if args.wait else 0
    print(f"diff against catalog version {version}:" if version else "no catalog applied yet:")
    for line in format_diff(diff, cat):
        print("  " + line)
    if args.dry_run:
        print("dry run: nothing applied")
        return 0
    started = time.monotonic()
    # The apply is a trace's root when tracing is on (docs/tracing.md): the reconcile it kicks is its
    # child through the task's headers, and the launches of the replicas that pass creates are the
    # pass's children through their records. Its spans are exported as the command exits: within
    # EXPORT_TIMEOUT seconds, so a collector that is down delays the command by that at most.
    with tracing.configure("llmgw", export_timeout=EXPORT_TIMEOUT).span("llmgw.catalog_apply", kind="producer",
                                         attributes={"llmgw.catalog.hash": cat.hash()}) as span:
        try:
            new_version, changed = replicated(lambda: apply_catalog(
                r, cat, source=os.path.abspath(args.file), applied_by=who(), expected_version=version
            ))
        except CatalogConflict as e:
            span.fail(str(e), "conflict")
            print(f"llmgw: {e}; nothing was applied", file=sys.stderr)
            return EXIT_CONFLICT
        span.set("llmgw.catalog.version", new_version)
        span.set("llmgw.catalog.changed", changed)
        if changed:
            print(f"applied catalog version {new_version} (hash {cat.hash()})")
            kick(s, r, RECONCILE, headers=span.carrier())
        else:
            print(f"unchanged: catalog version {new_version} already has this content (hash {cat.hash()})")
    return wait_ready(r, cat, args.timeout, started) if args.wait else 0


def wait_ready(store: Store, cat: Catalog, timeout: float, started: float, poll: float = 0.05) -> int:
    """`apply --wait`: until every profile has its replicas of the applied spec Ready and in the
    published endpoint list; print when each profile got its first and its last one, and a progress
    line per replica meanwhile (llmgw.cli.progress)."""
    progress = Progress(prefix="  ")
    ticker = Ticker(progress, store, models=[m.name for m in cat.models])
    want = {(m.name, p.name): p.replicas for m, p in cat.profiles()}
    hashes = {(m.name, p.name): profile_spec_hash(m, p) for m, p in cat.profiles()}
    first: dict[tuple[str, str], float] = {}
    done: dict[tuple[str, str], float] = {k: 0.0 for k, n in want.items() if n == 0}
    deadline = started + timeout
    while True:
        _v, _fp, eps = store.read_endpoints()
        listed = {e.id for e in eps}
        ready: dict[tuple[str, str], int] = {}
        for rec in store.all_replicas():
            key = (rec.model, rec.profile)
            if rec.id in listed and hashes.get(key) == rec.spec_hash:
                ready[key] = ready.get(key, 0) + 1
        t = time.monotonic() - started
        for key, n in want.items():
            if ready.get(key) and key not in first:
                first[key] = t
            if key not in done and ready.get(key, 0) >= n:
                done[key] = t
                ticker.tick(force=True)
                progress.say(f"{key[0]}/{key[1]}: {n} of {n} Ready after {t:.2f}s (first after {first.get(key, t):.2f}s)")
        if len(done) == len(want):
            print(f"all {sum(want.values())} replicas Ready after {t:.2f}s")
            return 0
        ticker.tick()
        if time.monotonic() >= deadline:
            ticker.tick(force=True)
            for key, n in want.items():
                if key not in done:
                    print(f"  {key[0]}/{key[1]}: {ready.get(key, 0)} of {n} Ready after {t:.0f}s "
                          "(see `llmgw status`)", file=sys.stderr)
            print(f"llmgw: timed out after {timeout:g}s waiting for Ready replicas", file=sys.stderr)
            return 1
        time.sleep(poll)


def _when(ts) -> str:
    try:
        return datetime.fromtimestamp(float(ts), timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    except (TypeError, ValueError):
        return "?"


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]


@_guard
def cmd_show(args) -> int:
    r = _redis()
    if args.version is not None:
        found = read_version(r, args.version)
        if found is None:
            print(f"llmgw: catalog version {args.version} is not in the history", file=sys.stderr)
            return EXIT_INVALID
        cat, meta = found
        version = args.version
    else:
        version, cat, meta = read_applied(r)
    output = "json" if args.json else args.output
    if output == "json":
        print_json({**meta, "version": version, "spec": cat.canonical() if cat else None})
        return 0
    if cat is None:
        if output == "yaml":
            print("llmgw: no catalog applied yet: nothing to print (llmgw catalog apply FILE)", file=sys.stderr)
            return EXIT_INVALID
        print("no catalog applied yet (llmgw catalog apply FILE)")
        return 0
    if output == "yaml":
        print(yaml_header(version, meta) + compact_yaml(cat), end="")
        return 0
    print(
        f"catalog version {version} (hash {meta.get('hash')}), applied {_when(meta.get('applied_at'))} "
        f"by {meta.get('applied_by')} from {meta.get('source')}: {_summary(cat)}"
    )
    rows = [["MODEL", "PROFILE", "ENGINE", "REPLICAS", "HARDWARE", "PRIORITY", "WEIGHT", "POOL", "CAPACITY", "ALIASES"]]
    for m, p in cat.profiles():
        if p.urls:  # engine: external
            hw = ", ".join(p.urls)
        elif p.gpu is None:
            hw = "cpu"
        else:
            hw = f"{p.gpu.count}x{p.gpu.gpu_class}" + (f" x{p.nodes} nodes" if p.nodes > 1 else "")
        count = f"auto {p.autoscale.min}..{p.autoscale.max}" if p.autoscale else str(p.replicas)
        rows.append([m.name, p.name, p.engine, count, hw, str(p.priority), f"{p.weight:g}", p.pool,
                     str(p.capacity), ",".join(m.aliases) or "-"])
    for line in _table(rows):
        print(line)
    return 0


def yaml_header(version: int, meta: dict) -> str:
    """The comment lines above `show -o yaml`: which version it is, and how to apply an edited copy."""
    return (f"# llmgw catalog version {version} (hash {meta.get('hash')}), applied {_when(meta.get('applied_at'))} "
            f"by {meta.get('applied_by')}\n# from {meta.get('source')}\n"
            "# Fields left out take their defaults (docs/catalog.md). Edit a copy, then:\n"
            "#   llmgw catalog apply FILE --dry-run   # the diff\n"
            "#   llmgw catalog apply FILE\n")


@_guard
def cmd_history(args) -> int:
    r = _redis()
    items = r.catalog_history(args.n)
    if args.json:
        print_json(items)
        return 0
    if not items:
        print("no catalog applied yet")
        return 0
    rows = [["VERSION", "APPLIED (UTC)", "BY", "HASH", "MODELS", "REPLICAS", "SOURCE"]]
    for it in items:
        rows.append([str(it.get("version")), _when(it.get("applied_at")), str(it.get("applied_by")),
                     str(it.get("hash")), str(it.get("models")), str(it.get("replicas")), str(it.get("source"))])
    for line in _table(rows):
        print(line)
    return 0
