"""Helpers every CLI command shares: settings, the Redis connection, output."""

from __future__ import annotations

import json
import sys

from llmgw.settings import Settings
from llmgw.state.store import Store, connect


def settings() -> Settings:
    return Settings.from_env()


def store(s: Settings | None = None) -> Store:
    return Store(connect((s or settings()).redis_url))


def print_json(obj) -> None:
    json.dump(obj, sys.stdout, indent=2, sort_keys=True, default=str)
    sys.stdout.write("\n")
