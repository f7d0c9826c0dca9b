"""Who gets in, who waits and who is refused: one pure step, `decide(result, queue, request, settings)`.

The proxy (gateway.http.proxy) routes a request (gateway.routing.router: a `Choice` with a slot
reserved, or a `Rejection`), asks `decide` what to do with that result, and carries the answer out:
`Send` the choice, `Queue` the request in its model's wait queue (gateway.routing.queue) for up to
a bound, or `Refuse` it with the reason (worded by gateway.http.refusal). When a queued request
leaves the queue, `after_wait` says what its wait came to. bench/fleetsim.py calls the same two
functions, so the simulator cannot drift from the gateway. Why a request waited or was refused is
this module and the values it was given.

Saturation (`admit`): a model is saturated when every one of its endpoints is (waiting >=
max_waiting, KV >= max_kv, or what it holds >= capacity), or when the router judged that waiting for
a full but much faster endpoint beats the open ones. Then:
- `critical` is always sent (the router picks the endpoint with the lowest expected completion);
- `sheddable` (and a batch line, class `batch`) gets 429 at once, and also whenever standard requests
  are already waiting, unless it outranks a running answer it may evict (`Request.displaces`,
  gateway.routing.eviction): then it waits for that answer's slot;
- `standard` waits in a bounded FIFO queue and is sent as soon as an endpoint frees. It is refused
  (429 with Retry-After) only when the queue cannot drain in time: at once when the estimated wait,
  its queue position over the fleet's learned completion rate, exceeds the wait bound, or when the
  queue is full, or when its wait actually reaches the bound.

A continuation (an answer that began, resumed after its engine broke off or evicted from its slot) is
work already admitted: it is never refused for saturation, counts against no queue bound, and waits
at the head of its key's queue (`Queue.head`) up to the request's total timeout. Where others wait it
takes no free slot before them: it lines up, and goes first only if it ranks first.

Requests waiting in the sibling workers' queues count (`Request.elsewhere`): a new request does not
take a slot that freed before the request that ranks first among all of them does (one order across
the workers, gateway.server.board); it lines up with them and routes at once if it ranks first.

Holds for a model or an adapter nothing serves yet:
- Cold start: a model that autoscales from zero (a profile with `min: 0`, `Tables.cold_start`) and
  has no endpoint: the request waits in the model's queue, counting against its bound, up to the
  model's `cold_start_timeout`, and the control plane is told at once (a demand hint) so a replica
  is placed now, not at the next timer tick.
- Restart: a model that had a replica lately and has none this request can reach now (every listed
  endpoint failed it, or none is listed: its last replica died and is restarting) waits up to
  LLMGW_GATEWAY_RESTART_HOLD for a replica to be published again (an endpoint it failed on counts
  again once its engine came back, gateway.routing.adapters.Lift), instead of a 503 while the
  control plane replaces it; the control plane is told at once.
- Adapter load: a LoRA adapter no endpoint holds (gateway.routing.adapters) waits up to the adapter's
  `wait` when a replica could load it (or its model can start from zero); the control plane is told
  for the adapter, and for its model when no replica of it runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.routing.adapters import NO_ADAPTER, AdapterRoute
from gateway.routing.choice import Choice, Rejection


@dataclass(frozen=True)
class Send:
    choice: Choice


@dataclass(frozen=True)
class Wait:
    """(`admit`) Join the model's queue: it is saturated, or others are already waiting ahead."""


@dataclass(frozen=True)
class Shed:
    reason: str
    retry_after: int = 1


@dataclass(frozen=True)
class Hold:
    """(`hold`) Wait in the model's queue up to `timeout` seconds for a replica or a holder."""

    timeout: float


@dataclass(frozen=True)
class TimedOut:
    """The request waited its whole bound (`seconds`) in the model's queue without an endpoint."""

    seconds: float


# Why a request waits or is refused: the label of its metrics and what its refusal says. RESUMING: an
# answer that began (a stream whose engine broke off, or an evicted one) waits for a slot to go on.
SATURATED, COLD_START, ADAPTER_LOAD, RESTART = "saturated", "cold_start", "adapter_load", "restart"
RESUMING = "resuming"
SHED_FIRST = ("sheddable", "batch")  # classes shed when their model is saturated (batch: a batch line)
GONE_KINDS = ("unknown_model", "no_ready")  # no endpoint listed, or none this request has not failed on


@dataclass(frozen=True)
class Queue:
    """Join the model's wait queue for up to `timeout` seconds. While it waits, the head of the queue
    routes again whenever a slot may have freed; a rejection of a kind in `keep` keeps it waiting,
    any other ends the wait. `give_back`: the result held a reserved slot, which goes back first
    (others are queued ahead). `demand`: the names the control plane is told about at once (a model
    to start from zero, an adapter to load)."""

    timeout: float
    why: str
    keep: tuple[str, ...] = (SATURATED,)
    give_back: bool = False
    demand: tuple[str, ...] = ()
    head: bool = False  # it waits at the head of its key's queue, counted against no bound (a continuation)


@dataclass(frozen=True)
class Refuse:
    """Refuse the request: `error` says why (a routing Rejection, a Shed, or a TimedOut wait). `shed`
    labels it in the shed metrics (empty: not counted as shed). `during` and `hold`: the hold it was
    refused in (COLD_START or ADAPTER_LOAD) and that hold's bound, for the wording. `give_back`: the
    result held a reserved slot."""

    error: Rejection | Shed | TimedOut
    shed: str = ""
    during: str = ""
    hold: float | None = None
    give_back: bool = False


@dataclass(frozen=True)
class Request:
    """What admission knows of one attempt of a request besides its routing result."""

    priority: str
    model: str = ""  # the canonical name of the model it asks for (what a cold start starts)
    first: bool = True  # its first attempt: a retry does not line up behind the queue again
    # Requests the fleet completes per second when full (drain time); read only for a saturated
    # result (`needs_rate`), else None.
    rate: float | None = None
    cold_start: float | None = None  # the model's cold-start timeout, when it scales from zero
    # How long it may wait for a replica to come back (the model had one lately; `needs_restart`),
    # else None.
    restart: float | None = None
    adapter: AdapterRoute | None = None  # the LoRA adapter it names, if any
    # It continues an answer that began (resumed after its engine broke off, or evicted): work already
    # admitted, never refused for saturation, waiting at the head of its key's queue.
    continuation: bool = False
    # It outranks a running answer that may be evicted (gateway.routing.eviction): read only for a
    # saturated result; it then waits for that answer's slot instead of being shed.
    displaces: bool = False
    # Requests of the model waiting in the sibling workers' queues (gateway.server.board): a slot that
    # is free now goes to the one that ranks first among all of them, so this one lines up with them.
    elsewhere: int = 0


@dataclass(frozen=True)
class Settings:
    queue_max: int
    queue_timeout: float
    resume_wait: float = 600.0  # how long a continuation waits for a slot (the request's total timeout)


def answered_as_shed(step: Refuse) -> bool:
    """Whether the client's answer to `step` is a shed (429: try later) rather than an error (no
    replica): a Shed, or a saturated wait that ran out; a hold that ran out means nothing serves."""
    return isinstance(step.error, Shed) or (isinstance(step.error, TimedOut) and not step.during)


def needs_restart(result: Choice | Rejection) -> bool:
    """Whether `decide` reads `Request.restart` for this result (whether the model had a replica lately)."""
    return isinstance(result, Rejection) and result.kind in GONE_KINDS


def needs_rate(result: Choice | Rejection) -> bool:
    """Whether `decide` reads `Request.rate` for this result (it costs a pass over the fleet's stats)."""
    return isinstance(result, Rejection) and result.kind == SATURATED


def decide(result: Choice | Rejection, queued: int, req: Request, cfg: Settings) -> Send | Queue | Refuse:
    """What to do with one routing result; `queued` is how many requests wait in the model's queue
    ahead of this one (its place in fair order, gateway.routing.fairness: all of them first come, first
    served)."""
    if req.continuation:
        if isinstance(result, Choice) and not (queued or req.elsewhere):
            return Send(result)
        if isinstance(result, Choice) or result.kind == SATURATED:  # others wait: it takes its place in order
            return Queue(cfg.resume_wait, RESUMING, head=True, give_back=isinstance(result, Choice))
        queued = 0  # a hold below never refuses it for a full queue
    if isinstance(result, Rejection):
        if result.kind == "unknown_model" and req.cold_start is not None:
            held = hold(req.cold_start, queued, cfg.queue_max)
            if isinstance(held, Shed):
                return Refuse(held, COLD_START, COLD_START, req.cold_start)
            return Queue(held.timeout, COLD_START, (SATURATED, "unknown_model"), demand=(req.model or result.model,))
        if result.kind in GONE_KINDS and req.restart:
            held = hold(req.restart, queued, cfg.queue_max)
            if isinstance(held, Shed):
                return Refuse(held, RESTART, RESTART, req.restart)
            return Queue(held.timeout, RESTART, (SATURATED,) + GONE_KINDS, demand=(req.model or result.model,))
        if result.kind == NO_ADAPTER and req.adapter is not None:
            route = req.adapter
            held = load_hold(route, queued, cfg.queue_max)
            if not isinstance(held, Hold):
                return Refuse(held or result, ADAPTER_LOAD, ADAPTER_LOAD, route.wait)
            demand = (route.name,) + ((route.model,) if route.can_cold_start and not route.servers else ())
            return Queue(held.timeout, ADAPTER_LOAD, (SATURATED, "unknown_model", NO_ADAPTER), demand=demand)
    if req.displaces and needs_rate(result):  # it takes a running answer's slot: it waits for it
        return Queue(cfg.queue_timeout, SATURATED)
    if req.elsewhere and req.first and isinstance(result, Choice) and req.priority != "critical":
        if req.priority in SHED_FIRST:  # standard requests wait (in a sibling worker)
            return Refuse(Shed("model saturated; sheddable requests are rejected first", 1), SATURATED, give_back=True)
        return Queue(cfg.queue_timeout, SATURATED, give_back=True)
    drain = drain_time(queued + 1, req.rate) if needs_rate(result) else None
    verdict = admit(result, req.priority, queued if req.first else 0, cfg.queue_max, cfg.queue_timeout, drain)
    reserved = isinstance(result, Choice)
    if isinstance(verdict, Send):
        return verdict
    if isinstance(verdict, Wait):
        return Queue(cfg.queue_timeout, SATURATED, give_back=reserved)
    if isinstance(verdict, Shed):
        return Refuse(verdict, SATURATED, give_back=reserved)
    return Refuse(verdict)


def after_wait(result: Choice | Rejection | None, queued: Queue) -> Send | Refuse:
    """What a wait in the queue came to: the endpoint it got, the rejection that ended it (the model
    or adapter went away), or its bound reached (`result` None)."""
    if isinstance(result, Choice):
        return Send(result)
    if queued.why == SATURATED:
        if result is None:
            return Refuse(TimedOut(queued.timeout), "queue_timeout")
        return Refuse(result)
    if queued.why == COLD_START:  # whatever ended it, the model did not start in time
        return Refuse(TimedOut(queued.timeout), "cold_start_timeout", COLD_START, queued.timeout)
    if queued.why == RESTART:
        return Refuse(result or TimedOut(queued.timeout), "restart_timeout", RESTART, queued.timeout)
    if queued.why == RESUMING:
        return Refuse(result or TimedOut(queued.timeout), "", RESUMING, queued.timeout)
    return Refuse(result or TimedOut(queued.timeout), "adapter_load_timeout", ADAPTER_LOAD, queued.timeout)


def drain_time(position: int, rate: float | None) -> float | None:
    """Seconds until the request at queue `position` (1 = head) gets an endpoint, when every endpoint
    is full and they complete `rate` requests per second between them; None when the rate is unknown."""
    if not rate or rate <= 0:
        return None
    return position / rate


def admit(result: Choice | Rejection, priority: str, queue_len: int, queue_max: int, queue_timeout: float,
          drain: float | None = None):
    """The saturation rule for one routing result. `queue_len` is how many wait ahead; `drain` is
    `drain_time` for this request's place in the queue. Unknown-model / no-Ready rejections are not
    admission's business and are returned unchanged for the caller's error table."""
    if isinstance(result, Rejection) and result.kind != SATURATED:
        return result
    if priority == "critical":
        # choose() never rejects critical traffic for saturation.
        return Send(result) if isinstance(result, Choice) else Shed("saturated", 1)
    if priority in SHED_FIRST and (isinstance(result, Rejection) or queue_len > 0):
        return Shed("model saturated; sheddable requests are rejected first", 1)
    if isinstance(result, Choice):
        # The router saw the queue (RouteRequest.queued): a Choice means an open endpoint serves this
        # request sooner than waiting behind the queued ones for a faster endpoint would.
        return Send(result)
    if queue_len >= queue_max or queue_timeout <= 0:
        return Shed("model saturated and its queue is full", max(1, math.ceil(queue_timeout)))
    if drain is not None and drain > queue_timeout:
        return Shed(f"model saturated; its queue would take about {drain:.0f}s to reach this request, "
                    f"over the {queue_timeout:g}s wait bound", max(1, math.ceil(drain - queue_timeout)))
    return Wait()


def hold(timeout: float, queue_len: int, queue_max: int) -> Hold | Shed:
    """A request for a model at zero replicas: wait for the cold start, unless its queue is full."""
    if queue_len >= queue_max:
        return Shed(f"the model is starting and {queue_len} requests already wait for it", retry_after(timeout))
    return Hold(timeout)


def load_hold(route: AdapterRoute, queue_len: int, queue_max: int) -> Hold | Shed | None:
    """Whether a request for an adapter no endpoint holds waits for a load (None: it cannot end well)."""
    if not route.loadable:
        return None
    return hold(route.wait, queue_len, queue_max)


def retry_after(timeout: float) -> int:
    """Seconds a client is told to wait before it retries a request a hold did not serve."""
    return max(1, min(30, math.ceil(timeout / 6)))
