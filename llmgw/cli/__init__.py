"""The `llmgw` command. Each command group lives in its own module with `register(subparsers)`.

Errors from llmgw (`LlmgwError`) are printed as one clear line and exit non-zero; a traceback never
reaches the user. Without REDIS_URL / LLMGW_REDIS_URL, commands use the Redis of the local stack
`llmgw up` runs from this directory or LLMGW_STATE_DIR (`llmgw.cli.common.locate`).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from llmgw.cli.common import locate
from llmgw.errors import LlmgwError, RedisUnreachable
from llmgw.state.store import RedisError

# Command-group modules, in the order `llmgw --help` lists them.
GROUPS = ("up", "catalog", "status", "events", "explain", "node", "models", "engines", "logs", "keys", "usage", "batches")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmgw", description="LLM gateway and control plane")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in GROUPS:
        importlib.import_module(f"llmgw.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except LlmgwError as e:
        hint = locate().hint() if isinstance(e, RedisUnreachable) else ""
        print(f"llmgw: {e}{hint}", file=sys.stderr)
        return getattr(e, "exit_code", 1)
    except RedisError as e:  # any command: a dead Redis is one line, never a traceback
        found = locate()
        print(f"llmgw: {RedisUnreachable(found.settings.redis_url, e)}{found.hint()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
