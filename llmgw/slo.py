"""Latency targets (service-level objectives) a request asks for, pure: what they are (`Targets`), how
a duration is written (`parse_duration`), where a request's come from (`resolve`: its headers, else its
key's defaults, else its model's in the catalog), and whether an answer met them (`met`).

- `ttft`: seconds from the request's arrival at the gateway to the first byte its client receives (a
  streamed answer's first token; a whole answer's body).
- `tpot`: seconds per output token after the first (a streamed answer; measured when its usage says
  how many tokens it had).
- `deadline`: seconds from its arrival to the end of the whole answer.
- `strict`: a request predicted to miss them is refused at once (429) rather than served late.

The gateway (gateway.request.targets reads the headers, gateway.request.plan resolves them into the
request's Plan), the key commands (llmgw.state.keypolicy) and the catalog (llmgw.catalog.slo) write
durations the same way: `500ms`, `0.5s`, `2s`, `5m`, `1h`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h)\s*$")
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
LONGEST = 7 * 86400.0  # a batch's longest completion window: no target is further away
EXAMPLES = "500ms, 0.5s or 2s"


class BadDuration(ValueError):
    """A duration that cannot be read: the reason, in words."""


def parse_duration(text: object) -> float:
    """Seconds of a duration written with its unit (`500ms`, `0.5s`, `2s`, `5m`, `1h`); raises
    BadDuration saying why. A bare number is refused: `500` could mean milliseconds or seconds."""
    if not isinstance(text, str):
        raise BadDuration(f"expected a duration with its unit such as {EXAMPLES}, got {text!r}")
    m = _DURATION.match(text)
    if not m:
        hint = " (give its unit: ms or s)" if re.fullmatch(r"\s*[\d.]+\s*", text) else ""
        raise BadDuration(f"expected a duration such as {EXAMPLES}, got {text!r}{hint}")
    seconds = float(m.group(1)) * _UNIT[m.group(2)]
    if not 0 < seconds <= LONGEST or not math.isfinite(seconds):
        raise BadDuration(f"must be more than 0 and at most 7 days, got {text!r}")
    return seconds


def format_duration(seconds: float) -> str:
    """A duration as `parse_duration` reads it: milliseconds under 10 s, else seconds."""
    if seconds < 10:
        return f"{seconds * 1000:g}ms"
    return f"{seconds:g}s"


@dataclass(frozen=True, slots=True)
class Targets:
    """A request's latency targets, in seconds (None: not asked)."""

    ttft: float | None = None
    tpot: float | None = None
    deadline: float | None = None
    strict: bool = False

    def __bool__(self) -> bool:
        return self.ttft is not None or self.tpot is not None or self.deadline is not None

    def over(self, under: "Targets") -> "Targets":
        """Each target of these, else `under`'s (a header over a key's default over a model's); strict
        if either says so."""
        return Targets(self.ttft if self.ttft is not None else under.ttft,
                       self.tpot if self.tpot is not None else under.tpot,
                       self.deadline if self.deadline is not None else under.deadline,
                       self.strict or under.strict)

    def describe(self) -> str:
        """`ttft 300ms, tpot 80ms, deadline 60s, strict`: for messages, `llmgw explain` and the console."""
        parts = [f"{name} {format_duration(v)}" for name, v in (("ttft", self.ttft), ("tpot", self.tpot),
                                                                ("deadline", self.deadline)) if v is not None]
        return ", ".join(parts + (["strict"] if self.strict else [])) or "none"


NO_TARGETS = Targets()


def resolve(asked: Targets, key: Targets | None, model: Targets | None) -> Targets:
    """A request's targets: what its headers ask, else its key's defaults, else its model's (each
    target on its own: a header's TTFT with a key's TPOT)."""
    out = asked
    if key is not None:
        out = out.over(key)
    if model is not None:
        out = out.over(model)
    return out


def met(t: Targets, ttft: float | None, tpot: float | None, total: float | None) -> bool:
    """Whether an answer met its targets: first byte after `ttft`, `tpot` seconds per token after the
    first (None: not measured, which does not count against it), whole after `total`, all from its
    arrival. An answer that did not end whole (None `total`) met none of them."""
    if total is None:
        return False
    if t.ttft is not None and (ttft is None or ttft > t.ttft):
        return False
    if t.tpot is not None and tpot is not None and tpot > t.tpot:
        return False
    return t.deadline is None or total <= t.deadline


def missed(t: Targets, ttft: float | None, tpot: float | None, total: float | None) -> str:
    """Which targets an answer missed, in words ("" when it met them all)."""
    if total is None:
        return "it did not end whole"
    out = []
    if t.ttft is not None and (ttft is None or ttft > t.ttft):
        out.append(f"first byte after {format_duration(ttft or 0.0)} (target {format_duration(t.ttft)})")
    if t.tpot is not None and tpot is not None and tpot > t.tpot:
        out.append(f"{format_duration(tpot)} per token (target {format_duration(t.tpot)})")
    if t.deadline is not None and total > t.deadline:
        out.append(f"whole after {format_duration(total)} (deadline {format_duration(t.deadline)})")
    return "; ".join(out)
