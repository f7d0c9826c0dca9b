"""`llmgw catalog validate|apply FILE` (minimal; the full command set comes with the catalog issue)."""

from __future__ import annotations

import getpass
import socket
import sys

from llmgw.catalog import load_catalog_file
from llmgw.catalog_store import apply_catalog
from llmgw.cli.common import settings, store
from llmgw.errors import CatalogInvalid


def register(sub) -> None:
    p = sub.add_parser("catalog", help="validate and apply the model catalog")
    csub = p.add_subparsers(dest="catalog_command", metavar="SUBCOMMAND", required=True)
    v = csub.add_parser("validate", help="check a catalog file; exit 2 with one line per problem")
    v.add_argument("file")
    v.set_defaults(func=cmd_validate)
    a = csub.add_parser("apply", help="validate a catalog file and store it as the next version")
    a.add_argument("file")
    a.set_defaults(func=cmd_apply)


def _load_or_report(path: str):
    try:
        return load_catalog_file(path)
    except CatalogInvalid as e:
        for p in e.problems:
            print(f"{e.source}: {p}", file=sys.stderr)
        return None


def cmd_validate(args) -> int:
    cat = _load_or_report(args.file)
    if cat is None:
        return 2
    print(f"{args.file}: ok ({len(cat.models)} models)")
    return 0


def cmd_apply(args) -> int:
    cat = _load_or_report(args.file)
    if cat is None:
        return 2
    s = store(settings())
    version, changed = apply_catalog(
        s.r, cat, source=args.file, applied_by=f"{getpass.getuser()}@{socket.gethostname()}"
    )
    print(f"catalog version {version}" + ("" if changed else " (unchanged)"))
    return 0
