"""The `llmgw` command. Each command group lives in its own module with `register(subparsers)`.

Errors from llmgw (`LlmgwError`) are printed as one clear line and exit non-zero; a traceback never
reaches the user.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from llmgw.errors import LlmgwError, RedisUnreachable
from llmgw.state.store import RedisError

# Command-group modules, in the order `llmgw --help` lists them.
GROUPS = ("up", "catalog", "status", "events", "explain", "node", "engines", "logs", "keys", "usage")


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
        print(f"llmgw: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 1)
    except RedisError as e:  # any command: a dead Redis is one line, never a traceback
        from llmgw.settings import Settings

        print(f"llmgw: {RedisUnreachable(Settings.from_env().redis_url, e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
