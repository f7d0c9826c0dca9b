"""The one attempt (gateway.http.attempt.Proxied): every send of a request goes through it, the retry
is the pure `next_attempt`'s, the tenant is charged once, and a continuation keeps its plan and charge."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gateway.config import GatewaySettings
from gateway.errors import ApiError
from gateway.http.attempt import Proxied, Sender
from gateway.observe.metrics import Metrics
from gateway.request.call import Call
from gateway.request.plan import Plan
from gateway.request.surface import ROUTES
from gateway.routing.choice import Choice
from gateway.routing.queue import WaitQueues
from gateway.upstream.client import UpstreamConnectError, UpstreamTimeout
from llmgw.state.keypolicy import Tenant
from llmgw.state.records import EndpointInfo
from llmgw.surface import CHAT
from tests.support.clock import FakeClock

A = EndpointInfo(id="a", url="http://a", models=("m",), engine="sim", model="m")
B = EndpointInfo(id="b", url="http://b", models=("m",), engine="sim", model="m")
C = EndpointInfo(id="c", url="http://c", models=("m",), engine="sim", model="m")
EXT = EndpointInfo(id="x", url="http://x", models=("m",), engine="external", model="m")
TEAM = Tenant("k-1", "team", 1.0, "")


class Router:
    """Takes back slots and notes what the attempts taught it."""

    def __init__(self, endpoints=(A, B)):
        self.tables = SimpleNamespace(api_keys={}, endpoints=tuple(endpoints), no_resume=frozenset())
        self.released, self.unreachable, self.timeouts, self.ok = [], [], [], []

    def release(self, choice, *a):
        self.released.append(choice.endpoint.id)

    def mark_unreachable(self, i):
        self.unreachable.append(i)

    def timed_out(self, i):
        self.timeouts.append(i)

    def answered(self, i):
        self.ok.append(i)


class Admission:
    """Hands out the first endpoint not excluded; records what each admission was asked."""

    def __init__(self, router):
        self.router, self.asked = router, []

    def admit(self, call, plan, exclude, first, last_error, trace, failed_at, continuation=False, arrived=None):
        self.asked.append((call, plan, exclude, first, continuation))
        for e in self.router.tables.endpoints:
            if e.id not in exclude:
                return Choice(e, 0.1, 0)
        raise ApiError("no_replica", "none left") if last_error is None else last_error


class Resp:
    def __init__(self, status):
        self.status, self.closed = status, False

    def close(self):
        self.closed = True


class Upstream:
    """Answers each send with the next scripted outcome: a status, or an exception to raise."""

    def __init__(self, *script):
        self.script, self.sent = list(script), []

    def send(self, url, path, body, headers, method, watch=None):
        self.sent.append((url, body))
        got = self.script.pop(0)
        if isinstance(got, Exception):
            raise got
        return Resp(got)


def exchange(upstream, router=None, retries=2, tenant=TEAM):
    router = router or Router()
    queues = WaitQueues(10)
    sender = Sender(GatewaySettings(retries=retries), FakeClock(0.0), router, upstream, Admission(router), queues,
                    Metrics())
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}
    call = Call(ROUTES[CHAT], "m", b'{"model": "m"}', body)
    return Proxied(sender, call, Plan("m", "standard", tenant), None, "rid", 0.0), router, queues


def test_a_retry_goes_elsewhere_and_the_tenant_is_charged_once():
    ex, router, queues = exchange(Upstream(UpstreamConnectError("refused"), 503, 200), router=Router((A, B, C)))
    hop = ex.send(first=True)
    assert hop.choice.endpoint.id == "c" and hop.resp.status == 200
    assert [sorted(a[2]) for a in ex.sender.admission.asked] == [[], ["a"], ["a", "b"]]
    assert router.unreachable == ["a"] and sorted(router.released) == ["a", "b"]  # c's slot is the hop's
    charged = queues.ledger.counter("m", TEAM.key)
    assert ex.charge is not None and charged == ex.charge.estimate > 0  # one charge for three attempts


def test_retries_follow_next_attempt_and_the_last_failure_is_raised():
    ex, router, _ = exchange(Upstream(UpstreamConnectError("x"), UpstreamConnectError("y")), retries=1)
    with pytest.raises(ApiError) as e:
        ex.send(first=True)
    assert e.value.kind == "no_replica" and router.unreachable == ["a", "b"]
    assert sorted(router.released) == ["a", "b"]  # every slot given back exactly once


def test_a_first_byte_timeout_is_not_retried():
    ex, router, _ = exchange(Upstream(UpstreamTimeout("slow"), 200))
    with pytest.raises(ApiError) as e:
        ex.send(first=True)
    assert e.value.kind == "upstream_timeout" and router.timeouts == ["a"] and router.released == ["a"]


def test_only_the_first_send_lines_up_behind_the_queue():
    ex, _, _ = exchange(Upstream(503, 200, 200))
    ex.send(first=True).close()
    assert [a[3] for a in ex.sender.admission.asked] == [True, False]
    assert not any(a[4] for a in ex.sender.admission.asked)  # the request itself: no continuation
    ex.send(exclude=frozenset({"a"})).close()  # a whole answer asked for again
    assert ex.sender.admission.asked[-1][3] is False


def test_a_continuation_keeps_the_plan_and_charge_and_skips_engines_that_cannot_continue():
    router = Router(endpoints=(EXT, A, B))
    ex, _, queues = exchange(Upstream(200, 200), router=router)
    ex.send(first=True).close()
    charge, plan = ex.charge, ex.plan
    cont = ex.call.continued({**ex.call.body, "messages": [*ex.call.body["messages"],
                                                           {"role": "assistant", "content": "Hel"}]})
    hop = ex.send(cont, exclude=frozenset({"x"}))
    call, got_plan, exclude, _, continuation = ex.sender.admission.asked[-1]
    assert call is cont and got_plan is plan and {"x"} <= exclude and continuation
    assert hop.choice.endpoint.engine != "external"  # the external server cannot continue an answer
    assert ex.charge is charge and queues.ledger.counter("m", TEAM.key) == charge.estimate
    assert cont.route is ex.call.route and cont.client is ex.call.client and cont.model == ex.call.model
