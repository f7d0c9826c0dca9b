"""`llmgw catalog validate|apply|show|history`: check, diff, apply and inspect the model catalog.

Exit codes: 0 success; 1 the applied catalog changed while applying (compare-and-set lost; nothing
written); 2 an invalid catalog, an unreadable file or an unreachable Redis. Never a traceback.
"""

from __future__ import annotations

import argparse
import getpass
import os
import socket
import sys
from datetime import datetime, timezone

import redis

from llmgw.catalog import (
    Catalog,
    apply_catalog,
    diff_catalogs,
    format_diff,
    history,
    load_catalog_file,
    read_applied,
    read_version,
)
from llmgw.cli.common import print_json, settings
from llmgw.errors import CatalogConflict, CatalogInvalid, RedisUnreachable
from llmgw.state.store import connect

EXIT_CONFLICT = 1
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
    a.set_defaults(func=cmd_apply)

    s = csub.add_parser("show", help="print the applied catalog")
    s.add_argument("--json", action="store_true", help="the stored document as JSON")
    s.add_argument("--version", type=int, default=None, metavar="N", help="a past version from the history")
    s.set_defaults(func=cmd_show)

    h = csub.add_parser("history", help="the last applied versions: who, when, hash")
    h.add_argument("-n", type=_positive, default=10, metavar="N", help="how many versions (default 10)")
    h.add_argument("--json", action="store_true")
    h.set_defaults(func=cmd_history)


def _who() -> str:
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no passwd entry in some containers
        user = f"uid{os.getuid()}"
    return f"{user}@{socket.gethostname()}"


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


def _redis():
    url = settings().redis_url
    r = connect(url)
    try:
        r.ping()
    except redis.RedisError as e:
        raise RedisUnreachable(url, e, exit_code=EXIT_INVALID) from e
    return r


def _guard(fn):
    """Redis errors after connecting become one line and exit 2, never a traceback."""

    def run(args) -> int:
        try:
            return fn(args)
        except redis.RedisError as e:
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
    r = _redis()
    version, current, _ = read_applied(r)
    diff = diff_catalogs(current, cat)
    if current is not None and current.hash() == cat.hash():
        print(f"unchanged: catalog version {version} already has this content (hash {cat.hash()})")
        return 0
    print(f"diff against catalog version {version}:" if version else "no catalog applied yet:")
    for line in format_diff(diff, cat):
        print("  " + line)
    if args.dry_run:
        print("dry run: nothing applied")
        return 0
    try:
        new_version, changed = apply_catalog(
            r, cat, source=os.path.abspath(args.file), applied_by=_who(), expected_version=version
        )
    except CatalogConflict as e:
        print(f"llmgw: {e}; nothing was applied", file=sys.stderr)
        return EXIT_CONFLICT
    if changed:
        print(f"applied catalog version {new_version} (hash {cat.hash()})")
    else:
        print(f"unchanged: catalog version {new_version} already has this content (hash {cat.hash()})")
    return 0


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
    if args.json:
        print_json({**meta, "version": version, "spec": cat.canonical() if cat else None})
        return 0
    if cat is None:
        print("no catalog applied yet (llmgw catalog apply FILE)")
        return 0
    print(
        f"catalog version {version} (hash {meta.get('hash')}), applied {_when(meta.get('applied_at'))} "
        f"by {meta.get('applied_by')} from {meta.get('source')}: {_summary(cat)}"
    )
    rows = [["MODEL", "PROFILE", "ENGINE", "REPLICAS", "HARDWARE", "PRIORITY", "WEIGHT", "POOL", "CAPACITY", "ALIASES"]]
    for m, p in cat.profiles():
        if p.gpu is None:
            hw = "cpu"
        else:
            hw = f"{p.gpu.count}x{p.gpu.gpu_class}" + (f" x{p.nodes} nodes" if p.nodes > 1 else "")
        rows.append([m.name, p.name, p.engine, str(p.replicas), hw, str(p.priority), f"{p.weight:g}", p.pool,
                     str(p.capacity), ",".join(m.aliases) or "-"])
    for line in _table(rows):
        print(line)
    return 0


@_guard
def cmd_history(args) -> int:
    r = _redis()
    items = history(r, args.n)
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
