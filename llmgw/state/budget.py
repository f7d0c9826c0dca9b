"""Token budgets of API keys: the UTC period a moment falls in, and when it resets. Pure.

A key with `--budget N --budget-period day|month` may spend N tokens (prompt + completion) per UTC
calendar day or month. Gateways count spent tokens per key and period id (`2025-06-01`, `2025-06`)
in Redis (`keys.budget`); the period id changes at 00:00 UTC, so nothing has to reset a counter.
"""

from __future__ import annotations

import calendar
import time
from dataclasses import dataclass
from datetime import datetime, timezone

BUDGET_PERIODS: tuple[str, ...] = ("day", "month")
DEFAULT_BUDGET_PERIOD = "month"
# A period's counter is kept this much longer than the period, so `llmgw usage` can still read it
# just after the reset (seconds).
COUNTER_GRACE = 2 * 86400


@dataclass(frozen=True)
class Period:
    id: str  # "2025-06-01" (a day) or "2025-06" (a month)
    start: float  # epoch seconds, inclusive
    end: float  # epoch seconds, exclusive: when the budget resets

    def seconds_left(self, now: float) -> float:
        return max(0.0, self.end - now)

    @property
    def counter_ttl(self) -> int:
        """Seconds its spent-tokens counter lives in Redis: the period's length and a grace."""
        return int(self.end - self.start) + COUNTER_GRACE


def period_of(kind: str, now: float) -> Period:
    """The UTC day or month holding `now` (`kind` is one of BUDGET_PERIODS). POSIX time has no leap
    seconds, so a UTC day is 86,400 s; plain time arithmetic (the gateway asks once per request of a
    key with a budget: datetime took ten times as long)."""
    if kind == "day":
        start = now - now % 86400
        return Period(time.strftime("%Y-%m-%d", time.gmtime(start)), start, start + 86400)
    if kind == "month":
        t = time.gmtime(now)
        start = calendar.timegm((t.tm_year, t.tm_mon, 1, 0, 0, 0))
        end = calendar.timegm((t.tm_year + (t.tm_mon == 12), t.tm_mon % 12 + 1, 1, 0, 0, 0))
        return Period(f"{t.tm_year:04d}-{t.tm_mon:02d}", float(start), float(end))
    raise ValueError(f"budget period must be one of {', '.join(BUDGET_PERIODS)}, got {kind!r}")


def iso(ts: float) -> str:
    """A UTC time as people and JSON read it: 2025-06-01T00:00:00Z."""
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
