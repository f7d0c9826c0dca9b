"""When a model is saturated, and when it recovers: the gateway's `model_saturated` / `model_recovered`
events, one of each per episode however many requests a storm queues or sheds.

The request path only counts, per model, the requests that had to queue and those shed because every
endpoint was saturated (`SaturationSignals`). The gateway's background loop hands the counts to the
pure `step(...)`, which opens an episode at the first signal (news: saturated) and closes it after
QUIET seconds without one (news: recovered, with how long it lasted and what it cost). Each process
has its own episodes; the shell also lets at most one event of a kind per model through every few
seconds for the whole fleet (`Store.emit_limited`), so many gateway processes make one event too.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Mapping

QUIET = 5.0  # seconds without a queued or shed request that end an episode


@dataclass(frozen=True)
class Episode:
    since: float
    last: float  # the latest signal
    queued: int = 0
    shed: int = 0


@dataclass(frozen=True)
class News:
    kind: str  # model_saturated | model_recovered
    model: str
    message: str
    queued: int = 0
    shed: int = 0


def step(episodes: Mapping[str, Episode], signals: Mapping[str, tuple[int, int]], now: float,
         quiet: float = QUIET) -> tuple[dict[str, Episode], list[News]]:
    """The episodes after `signals` ((queued, shed) per model since the last step) at `now`, and the
    news: each episode that opened or closed."""
    out: dict[str, Episode] = {}
    news: list[News] = []
    for model in sorted(set(episodes) | set(signals)):
        queued, shed = signals.get(model, (0, 0))
        ep = episodes.get(model)
        if queued or shed:
            if ep is None:
                ep = Episode(now, now)
                news.append(News("model_saturated", model, "every endpoint is saturated: "
                                 f"{queued} request(s) queued, {shed} shed so far", queued, shed))
            out[model] = replace(ep, last=now, queued=ep.queued + queued, shed=ep.shed + shed)
        elif ep is not None and now - ep.last >= quiet:
            news.append(News("model_recovered", model, f"saturated for {ep.last - ep.since:.0f}s: {ep.queued} "
                             f"request(s) queued, {ep.shed} shed", ep.queued, ep.shed))
        elif ep is not None:
            out[model] = ep
    return out, news


class SaturationSignals:
    """What the request path counts: per model, requests that queued and requests shed (saturation)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: dict[str, list[int]] = {}

    def queued(self, model: str) -> None:
        with self.lock:
            self.counts.setdefault(model, [0, 0])[0] += 1

    def shed(self, model: str) -> None:
        with self.lock:
            self.counts.setdefault(model, [0, 0])[1] += 1

    def take(self) -> dict[str, tuple[int, int]]:
        with self.lock:
            counts, self.counts = self.counts, {}
        return {m: (q, s) for m, (q, s) in counts.items()}
