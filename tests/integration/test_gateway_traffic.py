"""The gateway's traffic counts and saturation events with fake engines (fakeredis): what a request
adds to the console's charts, and a shed storm as one event."""

import time

from gateway.observe.traffic import slot_of
from llmgw.state import events, keys
from llmgw.state.records import LoadRecord
from tests.support.clock import FakeClock
from tests.support.gateway_app import CHAT, NEVER_STALE, endpoint, make_app, server, store  # noqa: F401


def test_the_gateway_counts_requests_and_a_shed_storm_is_one_event(store, upstreams):
    up = upstreams()
    clock = FakeClock(2_000_000_000.0, real_monotonic=True)
    _, gw, c = make_app(store, [endpoint("e1", up.url)], clock=clock, routing=NEVER_STALE)
    _, gw2, c2 = make_app(store, [endpoint("e1", up.url)], clock=clock, routing=NEVER_STALE)  # another process
    assert c.post(CHAT, json={"model": "m-alias", "messages": []}).status_code == 200
    assert c.post(CHAT, json={"model": "nope"}).status_code == 404  # unknown names are never counted
    store.write_load(LoadRecord("e1", time.time(), True, running=4, waiting=9))
    for g in (gw, gw2):
        g.pollers.refresh_loads()
    for client in (c, c2):
        for _ in range(3):
            r = client.post(CHAT, json={"model": "m"}, headers={"X-LLMGW-Priority": "sheddable"})
            assert r.status_code == 429
    gw.background.flush_traffic()
    gw2.background.flush_traffic()
    slot = store.r.hgetall(keys.traffic(slot_of(clock.t)))
    assert slot["m:n"] == "7" and slot["m:shed"] == "6" and "m:err" not in slot
    assert sum(int(v) for k, v in slot.items() if k.startswith("m:lat")) == 1
    assert sum(int(v) for k, v in slot.items() if k.startswith("m:ttft")) == 1
    saturated = [e for e in store.latest_events() if e.kind == "model_saturated"]
    assert len(saturated) == 1 and saturated[0].model == "m" and "3 shed" in saturated[0].message
    assert saturated[0].source == f"gateway:{gw.identity.id}"
    clock.t += 6  # quiet for longer than QUIET
    gw.background.flush_traffic()
    (recovered,) = [e for e in store.latest_events() if e.kind == "model_recovered"]
    assert recovered.data == {"queued": 0, "shed": 3}
