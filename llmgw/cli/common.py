"""Helpers every CLI command shares: settings, the Redis connection, output."""

from __future__ import annotations

import getpass
import json
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, TypeVar

from llmgw.errors import NotReplicated
from llmgw.local.stackfile import Lookup, find_stack
from llmgw.settings import Settings
from llmgw.state.kicks import Kicker, broker_app, celery_sender
from llmgw.state.store import Store, connect

T = TypeVar("T")

@dataclass(frozen=True)
class Located:
    """The settings a command runs with, and how its Redis URL was found: `lookup` is None when the
    environment named it, else the search for a local stack (which may have found none)."""

    settings: Settings
    lookup: Lookup | None

    def hint(self) -> str:
        """What to add to "cannot reach Redis": why no local stack was used."""
        if self.lookup is None or self.lookup.stack is not None:
            return ""
        if self.lookup.notes:
            return "; " + "; ".join(self.lookup.notes)
        dirs = " or ".join(str(d) for d in self.lookup.searched)
        return f"; no local stack found in {dirs} (`llmgw up` there starts one)"


def stack_dirs(s: Settings) -> list[Path]:
    """Where a running `llmgw up` is looked for: this directory's state dir, then LLMGW_STATE_DIR."""
    return [Path(Settings.model_fields["state_dir"].default).absolute(), s.state_dir]


def locate(s: Settings | None = None, find: Callable[[Iterable[Path]], Lookup] = find_stack) -> Located:
    """An explicit REDIS_URL / LLMGW_REDIS_URL always wins; otherwise the Redis of the local stack
    found in `stack_dirs` (llmgw.local.stackfile), else the default."""
    s = s or Settings.from_env()
    if "redis_url" in s.model_fields_set:
        return Located(s, None)
    lookup = find(stack_dirs(s))
    if lookup.stack is not None:
        s = s.model_copy(update={"redis_url": lookup.stack.redis_url})
    return Located(s, lookup)


def settings() -> Settings:
    """The command's settings (`locate`); a stack file that was ignored is one line on stderr."""
    found = locate()
    for note in found.lookup.notes if found.lookup else ():
        print(f"llmgw: {note}", file=sys.stderr)
    return found.settings


def who() -> str:
    """Who runs this command, for the records and events it writes: user@host."""
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no passwd entry in some containers
        user = f"uid{os.getuid()}"
    return f"{user}@{socket.gethostname()}"


def store(s: Settings | None = None) -> Store:
    s = s or settings()
    return Store(connect(s.redis_url), s.durability)


def replicated(write: Callable[[], T]) -> T:
    """`write()`, a store write that must not be lost (a catalog apply, an API key's change). When the
    replicas it waits for fall short (NotReplicated), the write stands: say so on stderr and go on with
    what it returned."""
    try:
        return write()
    except NotReplicated as e:
        print(f"llmgw: warning: {e}", file=sys.stderr)
        return e.value


def print_json(obj) -> None:
    json.dump(obj, sys.stdout, indent=2, sort_keys=True, default=str)
    sys.stdout.write("\n")


def kick(s: Settings, st: Store, *tasks: str, headers: dict[str, str] | None = None) -> None:
    """Tell the control plane a fact changed, so it reacts now rather than at its next timer tick
    (llmgw.kicks; best effort: the timer is the backstop). `headers`: a trace context carrier for
    the tasks sent (llmgw.tracing)."""
    if not s.event_driven:
        return
    app = broker_app(s.redis_url)
    try:
        kicker = Kicker(st, celery_sender(app))
        for task in tasks:
            kicker.kick(task, headers)
    finally:
        app.close()
