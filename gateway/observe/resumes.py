"""Answers whose engine broke off, for the event history: the request path counts each break per
model, cause and outcome (`ResumeSignals.hop`); the gateway's background loop takes the counts every
flush and writes one `stream_resumed` event per model that had breaks (`news`, pure), so an engine
that dies under a hundred streams is one event, not a hundred. The per-request detail is in the
log, the trace and the `llmgw_gateway_stream_resumes` counter.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Mapping

# What became of an answer whose engine broke off (gateway.http.resume):
# resumed - its stream goes on from another endpoint; retried - a whole answer asked for again
# elsewhere; finished - it had ended (only its closing events were missing); cut - it ended with an
# error event (a resume could not be exact, or was off, or nothing took it).
OUTCOMES = ("resumed", "retried", "finished", "cut")


@dataclass(frozen=True)
class News:
    model: str
    message: str
    counts: dict[str, int]  # outcome -> answers
    causes: dict[str, int]  # cause (reset, closed, stall, engine_error) -> breaks


def news(signals: Mapping[tuple[str, str, str], int]) -> list[News]:
    """One piece of news per model from the counts ((model, cause, outcome) -> breaks) since the last."""
    by_model: dict[str, tuple[dict[str, int], dict[str, int]]] = {}
    for (model, cause, outcome), n in sorted(signals.items()):
        counts, causes = by_model.setdefault(model, ({}, {}))
        counts[outcome] = counts.get(outcome, 0) + n
        causes[cause] = causes.get(cause, 0) + n
    out = []
    for model, (counts, causes) in by_model.items():
        done = ", ".join(f"{counts[o]} {o}" for o in OUTCOMES if counts.get(o))
        why = ", ".join(f"{n} {c}" for c, n in sorted(causes.items()))
        out.append(News(model, f"engines broke off {sum(causes.values())} answer(s) ({why}): {done}", counts, causes))
    return out


class ResumeSignals:
    """What the request path counts: (model, cause, outcome) -> breaks."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: dict[tuple[str, str, str], int] = {}

    def hop(self, model: str, cause: str, outcome: str) -> None:
        with self.lock:
            key = (model, cause, outcome)
            self.counts[key] = self.counts.get(key, 0) + 1

    def take(self) -> dict[tuple[str, str, str], int]:
        with self.lock:
            counts, self.counts = self.counts, {}
        return counts
