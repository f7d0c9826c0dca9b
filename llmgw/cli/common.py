"""Helpers every CLI command shares: settings, the Redis connection, output."""

from __future__ import annotations

import json
import sys

from llmgw.settings import Settings
from llmgw.state.kicks import Kicker, broker_app, celery_sender
from llmgw.state.store import Store, connect


def settings() -> Settings:
    return Settings.from_env()


def store(s: Settings | None = None) -> Store:
    return Store(connect((s or settings()).redis_url))


def print_json(obj) -> None:
    json.dump(obj, sys.stdout, indent=2, sort_keys=True, default=str)
    sys.stdout.write("\n")


def kick(s: Settings, st: Store, *tasks: str) -> None:
    """Tell the control plane a fact changed, so it reacts now rather than at its next timer tick
    (llmgw.kicks; best effort: the timer is the backstop)."""
    if not s.event_driven:
        return
    app = broker_app(s.redis_url)
    try:
        kicker = Kicker(st, celery_sender(app))
        for task in tasks:
            kicker.kick(task)
    finally:
        app.close()
