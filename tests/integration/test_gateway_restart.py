"""A model whose only replica dies and restarts (fakeredis, in-process fake engines): a request that
reaches it meanwhile waits for the replica to come back (LLMGW_GATEWAY_RESTART_HOLD) and is answered
there, instead of a 503; with the hold off, or past it, it gets the 503 that says why
(gateway.routing.admission, RESTART)."""

from __future__ import annotations

import threading
import time

from tests.support.gateway_app import CHAT, endpoint, make_app, server, store, wall_clock  # noqa: F401
from harness.procs import wait_until


def held(gw) -> bool:
    return len(gw.queues.get("m")) == 1


def test_a_request_waits_for_the_models_replica_to_restart_and_is_answered_there(store, upstreams):
    dead = upstreams(name="dead")
    _, gw, c = make_app(store, [endpoint("e1", dead.url)], clock=wall_clock())
    dead.stop()  # kill -9: connections refused from now on, and the endpoint still listed
    out = {}
    t = threading.Thread(target=lambda: out.update(r=c.post(CHAT, json={"model": "m"})))
    t.start()
    try:
        wait_until(lambda: held(gw), 10, interval=0.01, what="the request held for the model's replica")
        # The agent sees the engine exit: the endpoint is unpublished, then back on a new port.
        store.write_endpoints([], "fp-gone", time.time())
        gw.pollers.refresh_endpoints()
        back = upstreams(name="back")
        store.write_endpoints([endpoint("e1", back.url)], "fp-back", time.time())
        gw.pollers.refresh_endpoints()
        t.join(10)
        assert out["r"].status_code == 200 and out["r"].headers["X-LLMGW-Endpoint"] == "e1", out["r"].json
        assert back.stats["requests"] == 1
    finally:
        t.join(10)


def test_the_hold_is_bounded_and_says_why_and_can_be_turned_off(store, upstreams):
    dead = upstreams(name="dead")
    _, gw, c = make_app(store, [endpoint("e1", dead.url)], clock=wall_clock(), restart_hold=0.3)
    dead.stop()
    t0 = time.monotonic()
    r = c.post(CHAT, json={"model": "m"})
    assert r.status_code == 503 and r.json["error"]["code"] == "no_ready_replica", r.json
    assert "LLMGW_GATEWAY_RESTART_HOLD" in r.json["error"]["message"] and time.monotonic() - t0 >= 0.3
    _, gw, c = make_app(store, [endpoint("e1", dead.url)], clock=wall_clock(), restart_hold=0)
    r = c.post(CHAT, json={"model": "m"})
    assert r.status_code == 503 and "RESTART_HOLD" not in r.json["error"]["message"], r.json
    assert not held(gw)
