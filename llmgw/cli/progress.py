"""Progress of long waits (`llmgw up`, `llmgw catalog apply --wait`): one line per replica, its state,
how long it has been in it, and what it waits for.

On a terminal the lines are redrawn in place; piped, a replica gets a line only when its state or what
it waits for changes. `rows` turns `llmgw status`'s report (`build_status`) into rows; `frame` and
`changes` are the two renderings, pure; `Progress` writes them to a stream.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from dataclasses import dataclass
from typing import IO, Iterable, Mapping, Sequence

from llmgw.cli.explain import _crash_looping
from llmgw.cli.status import _age, gather_status
from llmgw.state.records import ReplicaRecord
from llmgw.state.replica_state import CrashPolicy, recent_failures
from llmgw.state.store import Store


@dataclass(frozen=True)
class Row:
    model: str
    profile: str
    replica: str
    state: str
    elapsed: float | None  # seconds in this state, when the record tells since when
    waiting: str  # what it waits for, or why it is stuck ("" when there is nothing to wait for)
    # Figures that move all the time (a download's bytes, rate, ETA): drawn on a terminal, never a
    # reason for a new line when piped.
    detail: str = ""

    @property
    def label(self) -> str:
        return f"{self.model}/{self.profile} {self.replica}"

    def status(self, detail: bool = False) -> str:
        """`Starting for 12s: waiting for its health check`; with `detail`, `Downloading for 9s: hf://o/r
        40% (41% 3.2 of 7.8 GiB, 110.0 MiB/s, ETA 42s)`. The time is how long it has been in that state
        ("for": `Ready 0.4s` read as "ready in 0.4 s")."""
        head = self.state if self.elapsed is None else f"{self.state} for {_age(self.elapsed)}"
        text = f"{head}: {self.waiting}" if self.waiting else head
        return f"{text} ({self.detail})" if detail and self.detail else text


def read(store: Store, now: float) -> tuple[dict, dict[str, ReplicaRecord]]:
    """What `rows` needs: `llmgw status`'s report and the replica records by id."""
    return gather_status(store, now), {r.id: r for r in store.all_replicas()}


def rows(report: dict, records: Mapping[str, ReplicaRecord], now: float,
         models: Iterable[str] | None = None) -> list[Row]:
    """One row per replica of the report (of `models` only, if given), in the report's order."""
    keep = None if models is None else set(models)
    return [Row(r["model"], r["profile"], r["id"], r["state"], _elapsed(r["state"], records.get(r["id"]), now),
                _waiting(r, records.get(r["id"]), now), r["reason"] if r["state"] == "Downloading" else "")
            for r in report["replicas"] if keep is None or r["model"] in keep]


def _since(state: str, rec: ReplicaRecord) -> float | None:
    """When the replica entered `state`, as far as its record tells."""
    if state == "Pending":
        return rec.created_at or None
    if state == "Launching":
        return rec.launch_dispatched_at or rec.created_at or None
    if state == "Starting":
        return rec.started_at
    if state == "Downloading":
        return rec.weights_started_at
    if state == "Ready":
        return rec.first_ready_at
    if state in ("Failed", "CrashLoop"):
        return rec.exited_at
    if state in ("Draining", "Stopping", "Stopped"):
        return rec.stop_requested_at
    return None


def _elapsed(state: str, rec: ReplicaRecord | None, now: float) -> float | None:
    since = _since(state, rec) if rec is not None else None
    return None if since is None else max(0.0, now - since)


def _waiting(row: dict, rec: ReplicaRecord | None, now: float) -> str:
    """What the replica waits for, in words that stay the same while nothing changes (no countdowns):
    piped output prints a line each time this changes."""
    state, reason = row["state"], row["reason"] or ""
    if state == "Ready":
        return "" if row.get("listed", True) else "waiting for the gateways' endpoint list to include it"
    if state == "Launching":
        return f"waiting for the node agent of {row['node']} to start it" if row.get("node") else reason
    if state == "Starting":
        if rec is not None and _crash_looping(rec, now):
            policy = CrashPolicy()
            return (f"crash loop ({recent_failures(rec, now, policy)} exits in {policy.window:g}s), "
                    "started again; waiting for its health check")
        return "waiting for its health check" + (f" (last probe: {reason})" if reason else "")
    if state == "Failed":
        return f"{reason}; restarting after a backoff"
    if state == "Downloading":
        return _download_step(row.get("download"))
    return reason


def _download_step(d: dict | None) -> str:
    """A download in steps that change seldom (its phase, then tens of percent): the figures go in `detail`."""
    if not d:
        return "downloading its weights"
    if d.get("phase") in ("downloading", "waiting", "verifying") and d.get("total"):
        return f"downloading {d['source']} {int(100 * d['done'] / d['total']) // 10 * 10}%"
    return f"{d.get('phase')} {d['source']}"


def lines(rows: Sequence[Row], detail: bool = False) -> list[str]:
    """The rows as aligned lines: label, then state, elapsed and what it waits for (and, with `detail`,
    the figures that move)."""
    width = max((len(r.label) for r in rows), default=0)
    return [f"{r.label.ljust(width)}  {r.status(detail)}" for r in rows]


def frame(rows: Sequence[Row], drawn: int, width: int, above: Sequence[str] = ()) -> tuple[str, int]:
    """For a terminal: the text that replaces the `drawn` lines last written with `above` (messages
    that stay, printed once) and the rows, each cut to the terminal's `width` so none wraps; and how
    many lines it drew (the next frame's `drawn`)."""
    out = []
    if drawn:
        out.append(f"\r\x1b[{drawn}A")  # back to the first line drawn
    out.append("\x1b[J")  # erase it and everything below
    out += [f"{text}\n" for text in above]
    body = [_fit(line, width) for line in lines(rows, detail=True)]
    out += [f"{line}\n" for line in body]
    return "".join(out), len(body)


def _fit(line: str, width: int) -> str:
    limit = max(width - 1, 10)
    return line if len(line) <= limit else line[: limit - 3] + "..."


def changes(rows: Sequence[Row], seen: Mapping[str, tuple[str, str]]) -> tuple[list[str], dict[str, tuple[str, str]]]:
    """For a pipe or a file: a line for each replica whose state or what it waits for differs from
    `seen` (replica id -> (state, waiting) last printed), and the new `seen`."""
    out, now_seen = [], {}
    for r in rows:
        key = (r.state, r.waiting)
        now_seen[r.replica] = key
        if seen.get(r.replica) != key:
            out.append(f"{r.label}  {r.status()}")
    return out, now_seen


class Progress:
    """Writes `frame`s on a terminal (stdout is a TTY and TERM is not `dumb`), `changes` elsewhere.
    `say` prints a message above the rows; `prefix` starts every line written when not redrawing."""

    def __init__(self, stream: IO[str] | None = None, prefix: str = "", tty: bool | None = None):
        self.stream = stream or sys.stdout
        self.prefix = prefix
        if tty is None:
            tty = _isatty(self.stream) and os.environ.get("TERM", "") != "dumb"
        self.tty = tty
        self.rows: list[Row] = []
        self.drawn = 0
        self.seen: dict[str, tuple[str, str]] = {}

    def show(self, rows: Sequence[Row]) -> None:
        self.rows = list(rows)
        if self.tty:
            self._draw(())
        else:
            printed, self.seen = changes(self.rows, self.seen)
            self._write("".join(f"{self.prefix}{line}\n" for line in printed))

    def say(self, text: str) -> None:
        if self.tty:
            self._draw([f"{self.prefix}{text}"])
        else:
            self._write(f"{self.prefix}{text}\n")

    def _draw(self, above: Sequence[str]) -> None:
        text, self.drawn = frame(self.rows, self.drawn, shutil.get_terminal_size((100, 24)).columns, above)
        self._write(text)

    def _write(self, text: str) -> None:
        if text:
            self.stream.write(text)
            self.stream.flush()


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class Ticker:
    """Refreshes a `Progress` from the store at most every `every` seconds, however often `tick` is
    called (the waits poll faster than a person reads)."""

    def __init__(self, progress: Progress, store: Store, models: Iterable[str] | None = None, every: float = 0.5):
        self.progress, self.store, self.every = progress, store, every
        self.models = None if models is None else list(models)
        self.last = float("-inf")

    def tick(self, force: bool = False) -> None:
        if not force and time.monotonic() - self.last < self.every:
            return
        self.last = time.monotonic()
        now = time.time()
        try:
            report, records = read(self.store, now)
        except Exception:  # noqa: BLE001 - progress output only: the wait goes on without it
            return
        self.progress.show(rows(report, records, now, self.models))
