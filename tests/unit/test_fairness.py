"""Fair queueing between API keys: the pure VTC decisions (gateway.routing.fairness), the counters and the
queue's order over them (gateway.routing.ledger), the wait queue with tenants (threads), the counters'
exchange through Redis (llmgw.state.store.tenants, gateway.server.fairshare on fakeredis), and what a key
record says about it (llmgw.state.keypolicy)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from gateway.observe.metrics import Metrics
from gateway.routing import fairness as fair
from gateway.routing.choice import Choice, Rejection
from gateway.routing.ledger import NO_TENANT, Backlog, Ledger
from gateway.routing.queue import WaitQueue, WaitQueues
from gateway.server.fairshare import FairShare
from llmgw.state import keys
from llmgw.state.keypolicy import (
    ApiKeyInvalid,
    ApiKeyRecord,
    Tenant,
    TenantRefused,
    parse_weight,
    tenant_of,
    updated,
)
from llmgw.state.records import EndpointInfo
from llmgw.state.tenants import TenantTotals, parse_totals, service_rows
from llmgw.surface import CHAT, EMBEDDINGS
from tests.support.clock import FakeClock
from harness.procs import wait_until

HEAVY, LIGHT = Tenant("k-h", "heavy"), Tenant("k-l", "light")
EP = EndpointInfo(id="a", url="http://a", models=("m",), engine="sim")
OK = Choice(EP, 0.1, 0)
SAT = Rejection("saturated", "m")


# --- the pure decisions ---------------------------------------------------------------------------------
def test_the_least_counter_goes_next_then_the_shorter_backlog_then_the_oldest():
    assert fair.next_of([("h", 10.0, 5, 1), ("l", 9.0, 1, 7)]) == "l"
    assert fair.next_of([("h", 10.0, 5, 1), ("l", 10.0, 1, 7)]) == "l"  # level: the one that sends little
    assert fair.next_of([("a", 10.0, 2, 3), ("b", 10.0, 2, 1)]) == "b"  # then the oldest waiter
    assert fair.next_of([("h", 10.0, 5, 1), ("l", 0.0, 1, 7)], fcfs=True) == "h"
    assert fair.next_of([]) is None


def test_a_joining_tenant_is_lifted_to_the_floor_less_one_request_never_lowered():
    assert fair.floor([5.0, 3.0], 9.0) == 3.0  # the least of those waiting
    assert fair.floor([], 9.0) == 9.0  # none waiting: the one served last
    assert fair.floor([], None) is None
    assert fair.lifted(0.0, 100.0, 10.0) == 90.0  # idle: no credit banked
    assert fair.lifted(500.0, 100.0, 10.0) == 500.0  # served more than the floor: kept
    assert fair.lifted(7.0, None, 10.0) == 7.0


def test_a_key_back_from_idle_level_with_the_floor_is_taken_one_request_below_it():
    assert fair.lifted(100.0, 100.0, 10.0, idle=True) == 90.0  # level: one request's place again
    assert fair.lifted(95.0, 100.0, 10.0, idle=True) == 90.0
    assert fair.lifted(0.0, 100.0, 10.0, idle=True) == 90.0  # below: lifted as ever
    assert fair.lifted(100.0, 100.0, 10.0) == 100.0  # requests still running or waiting: never lowered
    assert fair.lifted(105.0, 100.0, 10.0, idle=True) == 90.0  # just above: its answer's usage corrected it
    assert fair.lifted(120.0, 100.0, 10.0, idle=True) == 120.0  # served more than the floor: nothing forgiven
    assert fair.lifted(7.0, None, 10.0, idle=True) == 7.0


def test_a_light_key_that_sends_one_request_at_a_time_outranks_the_heavy_backlog_by_a_request():
    """bench.preempt's case: the slots are full of a heavy key's answers (charged when sent, so its
    counter stands still while they run) and a light key sends one request at a time. Charged its
    last request, it comes back level with the heavy key: level, it could not evict a heavy answer
    (gateway.routing.eviction: behind by more than half a request). Once that answer ended and it has
    nothing running or waiting anywhere, it joins one request below the heavy key, each time."""
    led, b = Ledger(), Backlog()
    for i in range(10):
        b.push(HEAVY, (HEAVY, i), led, "m")
    drain(b, led, 4)  # the four slots filled
    heavy = led.counter("m", HEAVY.key)
    for i in range(3):
        b.push(LIGHT, (LIGHT, i), led, "m")
        assert led.counter("m", LIGHT.key) == pytest.approx(heavy - 100.0), i
        head = b.head(led, "m")
        assert head == (LIGHT, i)
        b.remove(LIGHT, head)
        charge = led.sent("m", LIGHT, 100.0)
        assert led.counter("m", LIGHT.key) == pytest.approx(heavy)  # level while its answer runs
        if i == 2:
            nxt = (LIGHT, "next")
            b.push(LIGHT, nxt, led, "m")  # its next request before that answer ended: kept level
            assert led.counter("m", LIGHT.key) == pytest.approx(heavy)
            b.remove(LIGHT, nxt)
        charge.done((100, 0))
    # another worker holds one of its requests: not idle
    x = (LIGHT, "x")
    b.push(LIGHT, x, led, "m", elsewhere=lambda key: (key == LIGHT.key, None))
    assert led.counter("m", LIGHT.key) == pytest.approx(heavy)
    b.remove(LIGHT, x)
    # another worker's heavy head, as that worker sees the heavy key (its view lags ours by the charges
    # not exchanged yet): lifted below it, or its head would go first
    b.push(LIGHT, (LIGHT, "y"), led, "m", elsewhere=lambda key: (False, heavy - 250.0))
    assert led.counter("m", LIGHT.key) == pytest.approx(heavy - 350.0)


def test_what_a_request_is_charged():
    assert fair.cost(100, 50, 2.0) == 200.0
    assert fair.cost(-5, 10, 2.0) == 20.0
    assert fair.estimate(300, 100, 40, 2.0) == 280.0  # the expected prefix hit is not charged
    assert fair.estimate(300, 900, 0, 2.0) == 0.0
    assert fair.prompt_estimate(120.0, 4000) == 120.0 and fair.prompt_estimate(0.0, 4000) == 1000.0
    assert fair.output_estimate(None, None, True) == fair.DEFAULT_OUTPUT
    assert fair.output_estimate(64, 300.0, True) == 64.0  # never past max_tokens
    assert fair.output_estimate(True, 30.0, True) == 30.0  # a bool is no max_tokens
    assert fair.output_estimate(64, 300.0, False) == 0.0  # embeddings generate nothing
    assert fair.learn_output(None, 100) == 100.0 and fair.learn_output(100.0, 200) == 120.0


def test_a_light_tenant_s_place_is_not_the_backlog_s():
    # 200 of a heavy tenant's waiting: a light one with nothing waiting leaves second, not 201st.
    assert fair.fair_position(0, 1.0, [1.0], 200) == 2
    assert fair.fair_position(0, 1.0, [1.0], 200, fcfs=True) == 201
    assert fair.fair_position(150, 1.0, [1.0], 200) == 201  # never past the whole queue
    assert fair.fair_position(3, 2.0, [1.0], 100) == 6  # weight 2 of 3: 4 requests take 6 turns


def test_shares_over_two_readings():
    assert fair.shares({"a": 100, "b": 0}, {"a": 300, "b": 100}) == {"a": 2 / 3, "b": 1 / 3}
    assert fair.shares({"a": 5}, {"a": 5}) == {}


# --- the counters and the queue's order -------------------------------------------------------------------
def drain(backlog: Backlog, ledger: Ledger, n: int, cost: float = 100.0) -> list[str]:
    """Send `n` heads, each charged `cost`: the order the queue releases them in."""
    out = []
    for _ in range(n):
        head = backlog.head(ledger, "m")
        backlog.remove(head[0], head)
        ledger.sent("m", head[0], cost)
        out.append(head[0].name + (f"/{head[0].sub}" if head[0].sub else ""))
    return out


def test_a_light_tenant_overtakes_a_heavy_backlog():
    led, b = Ledger(), Backlog()
    for i in range(10):
        b.push(HEAVY, (HEAVY, i), led, "m")
    assert drain(b, led, 3) == ["heavy"] * 3
    b.push(LIGHT, (LIGHT, 0), led, "m")  # lifted to heavy's counter: level, and it sends little
    assert drain(b, led, 1) == ["light"]
    fcfs, q = Ledger(fcfs=True), Backlog()
    for i in range(3):
        q.push(HEAVY, (HEAVY, i), fcfs, "m")
    q.push(LIGHT, (LIGHT, 0), fcfs, "m")
    assert drain(q, fcfs, 4) == ["heavy", "heavy", "heavy", "light"]


def test_weights_share_the_turns_two_to_one():
    led, b = Ledger(), Backlog()
    a2, b1 = Tenant("k-a", "a", 2.0), Tenant("k-b", "b", 1.0)
    for i in range(60):
        b.push(a2, (a2, i), led, "m")
        b.push(b1, (b1, i), led, "m")
    order = drain(b, led, 60)
    assert order.count("a") == 40 and order.count("b") == 20


def test_a_tenant_back_from_idle_banks_nothing():
    led, b = Ledger(), Backlog()
    for i in range(100):
        b.push(HEAVY, (HEAVY, i), led, "m")
    drain(b, led, 50)  # light idle meanwhile: heavy's counter is 5000, light's 0
    for i in range(50):
        b.push(LIGHT, (LIGHT, i), led, "m")
    order = drain(b, led, 40)
    assert 19 <= order.count("light") <= 21  # its share, not 40 in a row to catch up
    # without the lift it would have taken every turn
    nolift, q = Ledger(), Backlog()
    nolift.join = lambda *a: None
    for i in range(100):
        q.push(HEAVY, (HEAVY, i), nolift, "m")
    drain(q, nolift, 50)
    for i in range(50):
        q.push(LIGHT, (LIGHT, i), nolift, "m")
    assert drain(q, nolift, 40).count("light") == 40


def test_sub_tenants_split_their_key_s_share_never_more():
    led, b = Ledger(), Backlog()
    front = [Tenant("k-f", "front", 1.0, s) for s in ("u1", "u2", "u3")]
    other = Tenant("k-o", "other")
    for i in range(30):
        b.push(other, (other, i), led, "m")
        for t in front:
            b.push(t, (t, i), led, "m")
    order = drain(b, led, 60)
    assert order.count("other") == 30  # the front end's three users together get its one share
    assert sorted(order.count(f"front/u{i}") for i in (1, 2, 3)) == [10, 10, 10]


def test_a_charge_is_corrected_by_the_answer():
    led = Ledger(output_weight=2.0)
    c = led.sent("m", HEAVY, 812.0)
    assert led.counter("m", "k-h") == 812.0
    usage = SimpleNamespace(cached=100)

    class Usage(tuple):
        cached = 100
    c.done(Usage((300, 150)))  # (300 - 100) + 2 x 150
    assert led.counter("m", "k-h") == 500.0
    assert led.expected_output("m", "k-h") == 150.0
    c2 = led.sent("m", HEAVY, 500.0)
    c2.done(None)  # said nothing: the estimate stands
    assert led.counter("m", "k-h") == 1000.0
    assert usage.cached == 100


def test_the_weight_divides_the_counter():
    led = Ledger()
    led.sent("m", Tenant("k-a", "a", 4.0), 400.0)
    assert led.counter("m", "k-a") == 100.0


def test_counters_from_two_processes_add_up():
    """A key spread over two processes is counted whole by each once they exchanged."""
    one, two = Ledger(), Ledger()
    one.sent("m", HEAVY, 100.0)
    two.sent("m", HEAVY, 300.0)
    redis: dict[str, TenantTotals] = {}

    def exchange(led: Ledger, read: bool) -> None:
        batch = led.take()
        for (_, kid), d in batch.items():
            t = redis.get(kid, TenantTotals())
            redis[kid] = TenantTotals(t.service + d.service, t.tokens + d.tokens, t.wait + d.wait,
                                      t.requests + d.requests)
        led.flushed(batch, {"m": dict(redis)} if read else {})

    exchange(one, False)
    assert one.counter("m", "k-h") == 100.0  # not read back: its own, kept
    exchange(two, True)
    assert two.counter("m", "k-h") == 400.0
    one.sent("m", HEAVY, 50.0)
    exchange(one, True)
    assert one.counter("m", "k-h") == 450.0 and redis["k-h"].requests == 3
    assert one.take() == {}  # all in Redis now
    exchange(one, True)
    assert one.counter("m", "k-h") == 450.0  # nothing counted twice
    redis.clear()  # Redis lost its data: every process counts from zero again
    exchange(one, True)
    assert one.counter("m", "k-h") == 0.0


def test_counted_alone_the_totals_only_feed_the_shares():
    led = Ledger()
    led.sent("m", HEAVY, 100.0)
    batch = led.take()
    led.flushed(batch, {"m": {"k-h": TenantTotals(5000.0, 5000.0), "k-l": TenantTotals(1.0, 1.0)}}, shared=False)
    assert led.counter("m", "k-h") == 100.0 and led.counter("m", "k-l") == 0.0


def test_a_tenant_s_backlog_fills_the_queue_for_itself_only():
    led, b = Ledger(), Backlog()
    for i in range(5):
        b.push(HEAVY, (HEAVY, i), led, "m")
    assert b.position(HEAVY, False) == 6
    assert b.position(LIGHT, False) == 2
    assert b.position(LIGHT, True) == 6  # fcfs: behind everyone


# --- the wait queue, with threads ---------------------------------------------------------------------------
def test_the_light_tenant_s_waiter_is_the_next_head():
    q = WaitQueue(max_len=10, recheck=60)
    order, results, threads = [], {}, []
    free = threading.Semaphore(0)

    def attempt_for(name):
        def attempt():
            if free.acquire(blocking=False):
                order.append(name)
                return OK
            return SAT
        return attempt

    def join(name, tenant):
        t = threading.Thread(target=lambda: results.__setitem__(name, q.wait(attempt_for(name), 10, tenant=tenant)))
        t.start()
        threads.append(t)
        wait_until(lambda: len(q) == sum(t.is_alive() for t in threads), 5, interval=0.001, what=f"{name} to wait")

    def free_one():
        free.release()
        q.notify()
        wait_until(lambda: free._value == 0, 5, interval=0.001, what="the slot to be taken")
        # what gateway.http.proxy does once a request leaves with a Choice: charge its tenant
        q.ledger.sent("", HEAVY if order[-1].startswith("h") else LIGHT, 100.0)

    try:
        for name in ("h1", "h2", "h3"):
            join(name, HEAVY)
        free_one()
        join("l1", LIGHT)  # heavy was served since: the light one is lifted level with it
        for _ in range(3):
            free_one()
    finally:
        for t in threads:
            t.join(10)
    assert order == ["h1", "l1", "h2", "h3"]  # the light one overtook h2 and h3
    assert all(r is OK for r in results.values())


def test_a_full_queue_refuses_the_backlogged_tenant_not_the_light_one():
    q = WaitQueue(max_len=2, recheck=60)
    stop = threading.Event()
    threads = [threading.Thread(target=q.wait, args=(lambda: SAT, 10), kwargs={"tenant": HEAVY, "gone": stop.is_set})
               for _ in range(2)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: len(q) == 2, 5, interval=0.001, what="the heavy tenant's two waiters")
        assert q.wait(lambda: SAT, 0.01, tenant=HEAVY) is None  # full for it
        assert q.wait(lambda: OK, 5, tenant=LIGHT) is OK  # not for the light one
    finally:
        stop.set()
        for w in list(q.waiters.fifos.get("k-h", {}).get("", ())):
            w[1].event.set()
        for t in threads:
            t.join(10)
    assert len(q) == 0


def test_the_queues_charge_a_sent_request_its_estimate():
    qs = WaitQueues(10)
    call = SimpleNamespace(model="m", body={"max_tokens": 50}, data=b"x" * 400, route=SimpleNamespace(op=CHAT))
    charge = qs.sent(call, SimpleNamespace(tenant=HEAVY, prompt_tokens=0.0), Choice(EP, 0.1, 0, matched=40.0))
    assert qs.ledger.counter("m", "k-h") == (100 - 40) + 2 * 50 and charge.estimate == 160.0
    embed = SimpleNamespace(model="m", body={}, data=b"y" * 40, route=SimpleNamespace(op=EMBEDDINGS))
    qs.sent(embed, SimpleNamespace(tenant=LIGHT, prompt_tokens=0.0), OK)
    assert qs.ledger.counter("m", "k-l") == 10.0
    assert qs.sent(call, SimpleNamespace(tenant=None, prompt_tokens=0.0), OK) is None


# --- the exchange through Redis ------------------------------------------------------------------------------
def test_two_workers_share_their_counters_through_redis(store):
    clock = FakeClock(1_000_000.0)
    a = WaitQueues(10, ledger=Ledger(monotonic=clock.monotonic))
    b = WaitQueues(10, ledger=Ledger(monotonic=clock.monotonic))
    metrics = Metrics()
    share_a = FairShare(store, a, clock, 0.05, metrics, name_of=lambda kid: "named-" + kid)
    share_b = FairShare(store, b, clock, 0.05)
    a.ledger.sent("m", HEAVY, 300.0)
    b.ledger.sent("m", HEAVY, 200.0)
    b.ledger.sent("m", LIGHT, 50.0)
    assert share_a.step() == 1 and share_b.step() == 2
    clock.advance(1.0)
    share_a.step()  # shares are read every SHARES_EVERY: a knows b's counts now
    assert a.ledger.counter("m", "k-h") == 500.0 and a.ledger.counter("m", "k-l") == 50.0
    totals = store.tenant_totals()
    assert totals["m"]["k-h"] == TenantTotals(500.0, 500.0, 0.0, 2)
    page = metrics.render().decode()
    assert 'llmgw_gateway_tenant_service_tokens_total{key="heavy",model="m"} 300.0' in page
    assert 'llmgw_gateway_tenant_share{key="heavy",model="m"}' in page
    assert share_a.step() == 0  # nothing counted, nothing waiting: no round trip
    assert set(store.r.keys(keys.tenants("m") + "*")) == {keys.tenants("m"),
                                                          keys.tenants_minute("m", int(1_000_000.0 // 60))}


def test_a_correction_below_what_was_shown_waits_for_the_next_charges(store):
    clock = FakeClock(1_000_000.0)
    qs = WaitQueues(10, ledger=Ledger(monotonic=clock.monotonic))
    metrics = Metrics()
    share = FairShare(store, qs, clock, 0.05, metrics)
    c = qs.ledger.sent("m", HEAVY, 800.0)
    share.step()
    c.done((100, 50))  # cost 200: 600 given back
    share.step()  # a Prometheus counter never goes down: carried
    qs.ledger.sent("m", HEAVY, 1000.0)
    share.step()
    page = metrics.render().decode()
    assert 'llmgw_gateway_tenant_service_tokens_total{key="heavy",model="m"} 1200.0' in page
    assert store.tenant_totals()["m"]["k-h"].tokens == 1200.0


def test_service_rows_for_the_views():
    rec = ApiKeyRecord("k-h", "heavy", weight=2.0)
    rows = service_rows({"k-h": rec}, {"m": {"k-h": TenantTotals(50.0, 100.0, 3.0, 4),
                                             "k-gone": TenantTotals(1.0, 1.0, 0.0, 0)}},
                        {"m": {1: {"k-h": "30", "k-gone": "10"}}})
    assert rows == [
        {"key": "heavy", "id": "k-h", "model": "m", "weight": 2.0, "service_tokens": 100, "requests": 4,
         "mean_wait": 0.75, "share": 0.75},
        {"key": "k-gone (revoked)", "id": "k-gone", "model": "m", "weight": 1.0, "service_tokens": 1,
         "requests": 0, "mean_wait": None, "share": 0.25}]
    assert parse_totals({"n:k": "1.5", "r:k": "2", "x:k": "9", "t:": "1", "w:k": "nan?"}) == {
        "k": TenantTotals(1.5, 0.0, 0.0, 2)}


# --- what a key says ------------------------------------------------------------------------------------------
def test_a_key_s_weight_and_who_may_name_sub_tenants():
    assert parse_weight("2") == 2.0 and parse_weight("0.5") == 0.5
    for bad in ("0", "-1", "lots", "1e9", "nan"):
        with pytest.raises(ApiKeyInvalid, match="--weight"):
            parse_weight(bad)
    rec = ApiKeyRecord("k-1", "app", "h")
    assert rec.weight == 1.0 and not rec.sub_tenants
    with pytest.raises(ApiKeyInvalid, match="--weight"):
        updated(rec, {"weight": 0.0})
    back = ApiKeyRecord.from_json("k-1", updated(rec, {"weight": 3.0, "sub_tenants": True}).to_json())
    assert (back.weight, back.sub_tenants) == (3.0, True)
    assert ApiKeyRecord.from_json("k-1", '{"hash": "h"}').weight == 1.0  # records from before weights
    with pytest.raises(ValueError, match="bad weight"):
        ApiKeyRecord.from_json("k-1", '{"hash": "h", "weight": -2}')
    assert tenant_of(rec, None) == Tenant("k-1", "app", 1.0, "")
    refused = tenant_of(rec, "alice")
    assert isinstance(refused, TenantRefused) and refused.kind == "untrusted"
    assert "llmgw keys update app --sub-tenants" in refused.message
    trusted = back
    assert tenant_of(trusted, "alice") == Tenant("k-1", "app", 3.0, "alice")
    assert tenant_of(trusted, "a b").kind == "malformed" and tenant_of(trusted, "x" * 65).kind == "malformed"
    assert tenant_of(None, "bob") == Tenant("anonymous", "anonymous", 1.0, "bob")  # no keys: all trusted
    assert NO_TENANT.key == ""
