"""One request's traffic with the engines, in one place. `Proxied.send` admits an attempt
(gateway.http.admit), sends it once (the endpoint's credential, the trace's attempt span,
`upstream.send`, what the router learns of the endpoint), asks the pure `retry.next_attempt` whether to
deliver, try another endpoint or give up, and returns the `Hop` that holds the slot and the response.

Every send of a request goes through it: the first, its retries, a whole answer asked for again on
another endpoint (gateway.http.answer), a stream's continuation after its engine broke off
(gateway.http.resume). A request is charged to its tenant once, by the first send that reaches an
endpoint; the charge stays with the request (`Proxied`), so a continuation keeps its tenant and its charge.
"""

from __future__ import annotations

import logging

from gateway.config import GatewaySettings
from gateway.errors import ApiError
from gateway.http.admit import Admission
from gateway.http.refusal import attempt_failed
from gateway.keys.table import ApiKey
from gateway.observe.feeders import FeederLines
from gateway.observe.metrics import Metrics
from gateway.request.call import Call, EngineRequest, engine_request
from gateway.request.plan import Plan
from gateway.routing.choice import Choice
from gateway.routing.ledger import Charge
from gateway.routing.queue import WaitQueues
from gateway.routing.retry import Deliver, GiveUp, Outcome, next_attempt
from gateway.routing.router import Lease, Router
from gateway.upstream.client import Upstream, UpstreamConnectError, UpstreamResponse, UpstreamTimeout
from llmgw.engines import ENGINES
from llmgw.state.clock import Clock
from llmgw.tracing import NOOP_REQUEST

log = logging.getLogger("llmgw.gateway")


class Hop:
    """One endpoint's part of an answer: its slot, its response, what it was sent (how its answer is
    read: assembled from a stream, its response ids rewritten) and when. `close` gives back both."""

    __slots__ = ("lease", "resp", "ask", "sent_at")

    def __init__(self, lease: Lease, resp: UpstreamResponse, ask: EngineRequest, sent_at: float):
        self.lease, self.resp, self.ask, self.sent_at = lease, resp, ask, sent_at

    @property
    def choice(self) -> Choice:
        return self.lease.choice

    def close(self) -> None:
        """The engine's request is abandoned (the engine sees the connection close and aborts it)."""
        self.resp.close()
        self.lease.release()


class FedLease(Lease):
    """A batch line's slot, counted for the feeder that sent it while it is held
    (gateway.observe.feeders: the report's `feeders`)."""

    __slots__ = ("lines", "feeder")

    def __init__(self, router: Router, choice: Choice, lines: FeederLines, feeder: str):
        super().__init__(router, choice)
        self.lines, self.feeder = lines, feeder
        lines.took(feeder)

    def release(self, service_time: float | None = None, tokens: int | None = None,
                ttfb: float | None = None) -> None:
        def slot() -> bool:
            if self.done:
                return False
            Lease.release(self, service_time, tokens, ttfb)
            return True

        if not self.done:
            self.lines.give_back(self.feeder, slot)


class Sender:
    """What every request's sends share in one gateway process (`feeders`: the batch lines it holds,
    by feeder)."""

    def __init__(self, cfg: GatewaySettings, clock: Clock, router: Router, upstream: Upstream, admission: Admission,
                 queues: WaitQueues, metrics: Metrics, feeders: FeederLines | None = None):
        self.cfg, self.clock, self.router, self.upstream = cfg, clock, router, upstream
        self.admission, self.queues, self.metrics = admission, queues, metrics
        self.feeders = feeders


class Proxied:
    """One client request, as every one of its sends needs it: the Call and its Plan, who asked, its id,
    when it arrived, its method, its trace, its charge, and the batch feeder it is a line of ("": none)."""

    __slots__ = ("sender", "call", "plan", "key", "rid", "t0", "method", "trace", "charge", "attempts", "feeder")

    def __init__(self, sender: Sender, call: Call, plan: Plan, key: ApiKey | None, rid: str, t0: float,
                 method: str = "POST", trace=NOOP_REQUEST, feeder: str = ""):
        self.sender, self.call, self.plan, self.key, self.rid, self.t0 = sender, call, plan, key, rid, t0
        self.method, self.trace, self.feeder = method, trace, feeder
        self.charge: Charge | None = None  # what its tenant was charged, once, when first sent
        self.attempts = 0  # the trace's number of the next attempt

    def resume_off(self) -> str | None:
        """Why this request's answer may not move to another endpoint once it began (None: it may)."""
        s = self.sender
        if self.plan.canon in s.router.tables.no_resume:
            return f"resuming is off for model {self.plan.canon!r} (its catalog's routing.resume)"
        return None if s.cfg.resumes else "resuming is off in this gateway (LLMGW_GATEWAY_RESUMES=0)"

    def send(self, call: Call | None = None, exclude: frozenset[str] = frozenset(), first: bool = False) -> Hop:
        """Admit, send and retry until an endpoint answers: the Hop, which the caller must close or
        hand on. `call`: another body of the same request (a continuation: only engines that continue
        an answer take it); `first`: the request's first send, which lines up behind the queue.
        Raises the ApiError that ends the request: its refusal, or its last attempt's failure."""
        s, trace = self.sender, self.trace
        if call is None:
            call = self.call
        else:
            exclude = exclude | {e.id for e in s.router.tables.endpoints if not continues(e.engine)}
        failed_at: dict[str, str] = {}  # endpoint -> the address it failed at
        last_error: ApiError | None = None
        tries = 0
        while True:
            try:
                choice = s.admission.admit(call, self.plan, exclude, first and not tries, last_error, trace, failed_at,
                                           continuation=call is not self.call, arrived=self.t0)
            except ApiError as e:
                trace.admitted(e.kind)
                raise
            trace.choice(choice.endpoint.id, choice.reason, choice.saturated)
            trace.admitted("send")
            if self.charge is None:  # its tenant charged what it is expected to cost, once
                self.charge = s.queues.sent(call, self.plan, choice)
            # From here the slot is ours: every path out of this block gives it back or hands it on.
            lines = s.feeders if self.feeder else None
            lease = Lease(s.router, choice) if lines is None else FedLease(s.router, choice, lines, self.feeder)
            resp = None
            try:
                ask = engine_request(call, self.plan.adapter, choice.endpoint, self.plan.rank, self.plan.cache_salt)
                sent_at = s.clock.monotonic()
                outcome, resp = self._once(call, ask, choice)
                step = next_attempt(outcome, tries, s.cfg.retries)
                if isinstance(step, Deliver):
                    hop, lease, resp = Hop(lease, resp, ask, sent_at), None, None
                    return hop
                last_error = self._failed(call, choice, outcome, step)  # raises on GiveUp
                exclude = exclude | {choice.endpoint.id}
                failed_at[choice.endpoint.id] = choice.endpoint.url
            finally:
                if resp is not None:
                    resp.close()
                if lease is not None:
                    lease.release()
            tries += 1

    def _once(self, call: Call, ask: EngineRequest, choice: Choice) -> tuple[Outcome, UpstreamResponse | None]:
        """One send to the chosen endpoint, and what the router learns of it."""
        s, ep = self.sender, choice.endpoint
        # The engine's credential, or an external server's own key (for this attempt only); never the
        # client's key (forward_headers drops it), never another endpoint's.
        secret = s.router.tables.api_keys.get(ep.id) or ep.engine_secret
        headers = {**call.headers, "authorization": f"Bearer {secret}"} if secret else dict(call.headers)
        self.trace.attempt(self.attempts, ep.id, ep.url + ask.path)
        self.attempts += 1
        self.trace.inject(headers)  # the engine's parent: this attempt (tracing off: the client's, as sent)
        try:
            resp = s.upstream.send(ep.url, ask.path, ask.body, headers, self.method, watch=call.client)
        except UpstreamConnectError as e:
            if call.client.gone():  # it left while the engine worked: not the engine's failure
                s.metrics.client_gone.labels(call.model, "answering").inc()
                raise ApiError("client_gone", f"the client left while endpoint {ep.id} answered") from None
            log.warning("request %s: cannot reach %s (%s): %s", self.rid, ep.id, ep.url, e)
            s.router.mark_unreachable(ep.id)
            return Outcome("connect_error"), None
        except UpstreamTimeout:
            s.router.timed_out(ep.id)
            return Outcome("timeout"), None
        s.router.answered(ep.id)
        return Outcome("answer", resp.status), resp

    def _failed(self, call: Call, choice: Choice, outcome: Outcome, step) -> ApiError:
        """An attempt that will not be delivered: counted, traced; raises the request's error when no
        other attempt follows, else returns what the request ends with if none serves it."""
        s, ep = self.sender, choice.endpoint
        metrics, timeout = s.metrics, s.cfg.first_byte_timeout
        self.trace.attempt_failed(outcome.kind, outcome.status or None, not isinstance(step, GiveUp))
        if isinstance(step, GiveUp):
            timed_out = step.kind == "upstream_timeout"
            metrics.upstream_errors.labels(ep.id, "timeout" if timed_out else "connect").inc()
            if timed_out:
                metrics.requests.labels(call.model, ep.id, "504").inc()
            raise attempt_failed(outcome, ep.id, call.model, timeout, step)
        metrics.upstream_errors.labels(ep.id, step.reason).inc()
        metrics.retries.labels(call.model).inc()
        return attempt_failed(outcome, ep.id, call.model, timeout)


def continues(engine: str) -> bool:
    """Whether an engine continues an assistant message (llmgw.engines: `continues_answers`)."""
    e = ENGINES.get(engine)
    return bool(e is not None and e.continues_answers)
