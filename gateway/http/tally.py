"""What an answer counts, when its first bytes come and when it ends: the metrics, the console's
traffic, the key's usage, the tenant's charge corrected by what the answer reported, and the sample
the router learns from (given back with the slot)."""

from __future__ import annotations

from gateway.http.attempt import Proxied, Hop
from gateway.keys.usage import UsageRecorder
from gateway.observe.metrics import Metrics
from gateway.observe.traffic import TrafficCounter
from gateway.routing.router import Lease
from llmgw.state.clock import Clock
from llmgw.state.keypolicy import ANONYMOUS


class Tally:
    """One answer's counts. Only generating operations teach the router an endpoint's speed, and only
    from the endpoint first sent to (an answer that moved to another teaches nothing); a stored
    response read again (by id) is not usage again."""

    __slots__ = ("clock", "metrics", "traffic", "usage", "open", "ex", "hop", "first_at")

    def __init__(self, clock: Clock, metrics: Metrics, traffic: TrafficCounter, usage: UsageRecorder, open_requests,
                 ex: Proxied, hop: Hop):
        self.clock, self.metrics, self.traffic, self.usage = clock, metrics, traffic, usage
        self.open = open_requests  # gateway.http.answer.OpenRequests
        self.ex, self.hop = ex, hop  # the request, and its first endpoint's part
        self.first_at: float | None = None  # when a stream's first bytes came

    def first(self) -> None:
        """A stream's first bytes went to the client."""
        ex = self.ex
        self.first_at = self.clock.monotonic()
        ex.trace.first_byte()
        waited = self.first_at - ex.t0
        self.metrics.child(self.metrics.ttft, ex.call.model).observe(waited)
        self.traffic.first_byte(ex.plan.canon, waited)

    def stream_end(self, completed: bool, usage, lease: Lease | None = None) -> None:
        """A stream ended; `lease`: the slot of the endpoint that answered last (else the first's)."""
        self.open.n -= 1  # counted by the WSGI entry, which left it to the stream
        self.end(lease or self.hop.lease, self.hop.resp.status, completed, usage)

    def whole(self, lease: Lease, status: int, usage) -> None:
        """A whole answer was read and is about to go to the client."""
        ex = self.ex
        waited = self.clock.monotonic() - ex.t0
        self.metrics.child(self.metrics.ttft, ex.call.model).observe(waited)
        self.traffic.first_byte(ex.plan.canon, waited)
        self.end(lease, status, True, usage)

    def end(self, lease: Lease, status: int, completed: bool, usage, charted: bool = True) -> None:
        """The answer ended (`completed`: passed on whole) with `status` and `usage`; `charted`: False
        when the error answer raised next is counted instead (gateway.http.proxy's `refused`)."""
        ex, metrics = self.ex, self.metrics
        now = self.clock.monotonic()
        ep, route, model = lease.choice.endpoint, ex.call.route, ex.call.model
        learn = route.learns and lease is self.hop.lease
        ok = completed and status < 400
        usage = usage if not route.by_id else None
        t_send, first_at = self.hop.sent_at, self.first_at
        lease.release((now - t_send) if ok and learn else None, usage[1] if usage and learn else None,
                      (first_at - t_send) if ok and learn and first_at is not None else None)
        child = metrics.child
        child(metrics.requests, model, ep.id, str(status) if completed else "aborted").inc()
        child(metrics.latency, model).observe(now - ex.t0)
        if charted:
            self.traffic.request(ex.plan.canon, error=not completed or status >= 500, seconds=now - ex.t0)
            ex.trace.finish(status, completed, usage)
        cached = getattr(usage, "cached", None)  # gateway.upstream.stream.Usage
        if cached is not None and status < 400:
            lease.router.reused(ep.id, usage[0], cached)
            child(metrics.prefix_measured, ep.id).inc(cached)
        if usage:
            child(metrics.tokens, model, "prompt").inc(usage[0])
            child(metrics.tokens, model, "completion").inc(usage[1])
        if ex.charge is not None:  # an engine's error answer cost next to nothing: given back
            ex.charge.done(usage if status < 400 else (0, 0))
        if status < 400:
            key = ex.key
            budget = key.period(self.clock.time()) if key is not None and key.budget else None
            self.usage.record(key.id if key else ANONYMOUS, ep.model or model, *(usage or (0, 0)),
                              limited=bool(key and key.tpm), budget=budget)
