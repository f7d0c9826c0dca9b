"""The wait queue with threads: requests waiting for a saturated model are served in order as
endpoints free."""

import threading

from gateway.routing.choice import Choice, Rejection
from gateway.routing.queue import WaitQueue
from llmgw.state.records import EndpointInfo
from harness.procs import wait_until

EP = EndpointInfo(id="a", url="http://a", models=("m",), engine="sim")
OK = Choice(EP, 0.1, 0)
SAT = Rejection("saturated", "m")


def test_queue_serves_in_order_when_endpoint_frees():
    q = WaitQueue(max_len=10, recheck=0.01)
    free = threading.Semaphore(0)
    order = []

    def attempt_for(name):
        def attempt():
            if free.acquire(blocking=False):
                order.append(name)
                return OK
            return SAT
        return attempt

    results = {}
    threads = []
    try:
        for name in ("first", "second"):
            t = threading.Thread(target=lambda n=name: results.__setitem__(n, q.wait(attempt_for(n), 10)))
            t.start()
            threads.append(t)
            # make sure "first" is enqueued before "second"
            wait_until(lambda: len(q) == len(threads), 5, interval=0.001, what=f"{name} to be enqueued")
        free.release()
        q.notify()
        free.release()
        q.notify()
    finally:
        for t in threads:
            t.join(15)
    assert not any(t.is_alive() for t in threads)
    assert order == ["first", "second"]
    assert results == {"first": OK, "second": OK}
