"""What the other gateways hold on each endpoint, as they last said: counted like sibling workers'.

Behind an L4 load balancer each gateway knows its own requests in flight exactly (its gunicorn
workers share theirs in memory, gateway.server.siblings) and the other gateways' only through the
engines' scrapes, a second or more late. At a busy fleet's rate that is many requests each gateway
does not see, and two gateways put turns into the same engine's last slots while another had room
(`python -m bench.fleetsim --workload prefix --gateways 2` against one; docs/history.md).
So every gateway says what it holds with the sends it shares (gateway.server.sendshare, every
`LLMGW_GATEWAY_SHARE_SENDS`), and the others count it as they count their sibling workers': in what
an endpoint holds now, and at its peak over the last PEAK_WINDOW for what a scrape may already show
(gateway.routing.learn subtracts it from the scrape, so it is never counted twice). A gateway that
stops saying is forgotten after STALE seconds: its requests ended with it.

Pure: the caller passes its monotonic clock; `InFlight` holds one, under its lock.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable, Mapping

# Seconds a report stays true: a gateway repeats its counts at least every REPEAT while it holds
# anything (and at once when they change), so a silence this long is a gateway gone.
STALE = 2.0
REPEAT = 0.5
# Seconds a peak is remembered, as the sibling workers' (gateway.server.siblings.PEAK_WINDOW): a
# scrape is at most about two load refreshes old when it is read.
PEAK_WINDOW = 3.0


class RemoteHolds:
    """Per other gateway (its origin), its reports of the last PEAK_WINDOW: (when, counts)."""

    def __init__(self) -> None:
        self.reports: dict[str, deque[tuple[float, Mapping[str, int]]]] = {}

    def learn(self, origin: str, counts: Mapping[str, int], at: float, now: float) -> None:
        """`origin` held `counts` at `at` (our monotonic clock). A report older than STALE says
        nothing any more (a gateway that starts reads the streams' past); an older one than the
        latest kept is out of order and dropped."""
        if now - at > STALE:
            return
        q = self.reports.get(origin)
        if q is None:
            q = self.reports[origin] = deque()
        elif q and at < q[-1][0]:
            return
        q.append((at, counts))
        while len(q) > 1 and now - q[1][0] >= PEAK_WINDOW:  # the last one before the window was true in it
            q.popleft()

    def others(self, endpoint_ids: Iterable[str], now: float, *, recent: bool = False) -> dict[str, int]:
        """What the other gateways hold on each endpoint, by their latest reports; with `recent`, the
        most each held in the last PEAK_WINDOW (what a scrape taken then may show). Gateways silent
        for STALE seconds are left out."""
        out: dict[str, int] = {}
        ids = list(endpoint_ids)
        for origin, q in list(self.reports.items()):
            if not q or now - q[-1][0] > STALE:
                del self.reports[origin]
                continue
            # With `recent`, every report that was still true at some moment of the window: those
            # made in it, and the last one before it.
            held = [c for i, (t, c) in enumerate(q) if i + 1 == len(q) or now - q[i + 1][0] < PEAK_WINDOW] \
                if recent else [q[-1][1]]
            for e in ids:
                n = max(c.get(e, 0) for c in held)
                if n > 0:
                    out[e] = out.get(e, 0) + n
        return out

    def __bool__(self) -> bool:
        return bool(self.reports)


def report_due(counts: Mapping[str, int], last: Mapping[str, int] | None, last_at: float, now: float) -> bool:
    """Whether this gateway should say what it holds now: when it changed since it last said, or
    REPEAT after that while it holds anything (so the others do not take it for gone)."""
    if last is None:
        return bool(counts)
    if counts != last:
        return True
    return bool(counts) and now - last_at >= REPEAT
