"""The gateway as users run it (gunicorn -c python:gateway.gunicorn_conf, the gevent worker) on a
real redis-server: ready before the first request, the report acknowledging a new endpoint list,
many open streams in one process, and a graceful stop that lets open streams finish."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import requests

from llmgw.state.records import EndpointInfo
from tests.support.fake_upstream import start_process
from harness.procs import wait_until

CHAT = "/v1/chat/completions"


def publish(cluster, urls: dict[str, str], capacity: int = 1000) -> int:
    eps = [EndpointInfo(id=i, url=u, models=("m",), engine="sim", model="m", served_name="m", capacity=capacity)
           for i, u in urls.items()]
    return cluster.store().write_endpoints(eps, "fp-" + "-".join(sorted(urls)), time.time())


def test_every_worker_is_ready_before_its_first_request_and_reports_new_lists(cluster):
    cluster.start_redis()
    engine = start_process(cluster.procs, "engine", base=0.01, max_seqs=64)
    publish(cluster, {"e1": engine})
    gw = cluster.start_gateway(LLMGW_GATEWAY_WORKERS="2")
    # Fresh connections land on either worker: none may answer "not loaded yet".
    statuses = [requests.post(gw + CHAT, json={"model": "m"}, headers={"Connection": "close"}, timeout=10)
                .status_code for _ in range(20)]
    assert statuses == [200] * 20
    health = requests.get(gw + "/healthz", timeout=5).json()
    assert health["gevent"] is True and health["ready"] is True
    assert requests.get(gw + "/readyz", timeout=5).json()["ready"] is True

    store = cluster.store()
    wait_until(lambda: len(store.gateway_reports()) == 2, 5, what="a report from each worker")
    version = publish(cluster, {"e1": engine, "e2": engine})
    # The pub/sub hint makes each worker load the list, and a report follows at once: the
    # acknowledgement the control plane waits for before it stops a replica, within a second.
    wait_until(lambda: all(r.version == version for r in store.gateway_reports()), 1.0,
               interval=0.02, what="both workers to report the new version within a second")
    reports = store.gateway_reports()
    assert {r.pid for r in reports} == {int(i.split(":")[1]) for i in (r.id for r in reports)}
    assert all(r.endpoints["e1"].ok_at for r in reports if "e1" in r.endpoints)
    assert sum(r.models["m"].last_request_at is not None for r in reports if "m" in r.models) >= 1


def test_readyz_says_why_until_redis_answers(cluster):
    cluster.start_redis()
    cluster.stop_redis()
    gw = cluster.start_gateway(LLMGW_GATEWAY_START_WAIT="0.2")
    r = requests.get(gw + "/readyz", timeout=5)
    assert r.status_code == 503 and "Redis unavailable" in r.json()["reason"]
    r = requests.post(gw + CHAT, json={"model": "m"}, timeout=5)
    assert r.status_code == 503 and r.json()["error"]["code"] == "auth_unavailable"
    cluster.restart_redis()
    publish(cluster, {"e1": start_process(cluster.procs, "engine", base=0.01)})
    wait_until(lambda: requests.get(gw + "/readyz", timeout=5).status_code == 200, 15, what="ready")
    wait_until(lambda: requests.get(gw + "/healthz", timeout=5).json()["endpoints"] == 1, 10, what="the list")
    assert requests.post(gw + CHAT, json={"model": "m"}, timeout=5).status_code == 200


def test_one_process_holds_many_open_streams(cluster):
    """More streams than the old thread-per-stream worker had threads (128), in one process, all at
    once: the gateway, not gunicorn's accept queue, holds them."""
    cluster.start_redis()
    engine = start_process(cluster.procs, "engine", base=3.0, tokens=3, max_seqs=400, gate=True)
    publish(cluster, {"e1": engine})
    gw = cluster.start_gateway()
    n = 300
    pool = ThreadPoolExecutor(n)
    try:
        futs = [pool.submit(requests.post, gw + CHAT, json={"model": "m", "stream": True}, timeout=120)
                for _ in range(n)]
        wait_until(lambda: requests.get(engine + "/stats", timeout=5).json()["active"] == n, 60,
                   what=f"{n} streams open at the engine")
        assert requests.get(gw + "/healthz", timeout=5).json()["open_requests"] == n
        requests.post(engine + "/gate", timeout=5)
        assert all(f.result().status_code == 200 and f.result().text.endswith("data: [DONE]\n\n") for f in futs)
    finally:
        cluster.procs.get("engine").stop()
        pool.shutdown(wait=True)


def test_sigterm_lets_open_streams_finish_and_refuses_new_ones(cluster):
    cluster.start_redis()
    engine = start_process(cluster.procs, "engine", base=2.0, tokens=10)
    publish(cluster, {"e1": engine})
    gw = cluster.start_gateway()
    with requests.post(gw + CHAT, json={"model": "m", "stream": True}, stream=True, timeout=30) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line).startswith(b"data:")
        proc = cluster.procs.get("gateway")
        proc.popen.send_signal(signal.SIGTERM)
        # stop accepting: new connections are refused (once the worker closed its listener)
        wait_until(lambda: _refused(gw), 10, what="new connections refused")
        rest = [line for line in lines if line]
    assert rest[-1] == b"data: [DONE]" and len(rest) == 10  # the open stream ran to its end
    proc.popen.wait(15)
    assert requests.get(engine + "/stats", timeout=5).json()["cancelled"] == 0


def test_sigterm_closes_idle_keepalive_connections_and_exits_when_the_last_stream_ends(cluster):
    """A client's connection kept open between requests holds no request: a stopping gateway closes it
    at once instead of waiting out its graceful timeout (30 s here) for it, and exits as soon as the
    open stream has ended."""
    import socket

    cluster.start_redis()
    engine = start_process(cluster.procs, "engine", base=1.0, tokens=5)
    publish(cluster, {"e1": engine})
    gw = cluster.start_gateway(graceful_timeout=30)
    port = int(gw.rsplit(":", 1)[1])
    idle = socket.create_connection(("127.0.0.1", port), timeout=20)
    try:
        idle.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += _received(idle)
        head, _, body = answer.partition(b"\r\n\r\n")
        length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")).split(b":")[1])
        while len(body) < length:
            body += _received(idle)
        assert head.startswith(b"HTTP/1.1 200")  # answered whole; the connection is now idle, kept alive
        with requests.post(gw + CHAT, json={"model": "m", "stream": True}, stream=True, timeout=30) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line).startswith(b"data:")
            proc = cluster.procs.get("gateway")
            proc.popen.send_signal(signal.SIGTERM)
            assert idle.recv(65536) == b""  # closed by the gateway while the stream still runs
            assert proc.popen.poll() is None
            rest = [line for line in lines if line]
        assert rest[-1] == b"data: [DONE]" and len(rest) == 5  # the open stream ran to its end
        proc.popen.wait(10)  # well before the 30 s graceful timeout: nothing else held it
    finally:
        idle.close()


def _received(sock) -> bytes:
    data = sock.recv(65536)
    assert data, "the connection closed before its answer was whole"
    return data


def _refused(gw: str) -> bool:
    try:
        requests.get(gw + "/healthz", timeout=2, headers={"Connection": "close"})
        return False
    except requests.ConnectionError:
        return True


def _read_answer(sock, deadline: float) -> tuple[bytes, list[bytes], bool]:
    """One chunked answer from a raw keep-alive socket: its head, its chunks' payloads, and whether
    it ended with the last chunk (False: the gateway closed the connection before it)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        data = sock.recv(65536)
        assert data, f"connection closed before the head: {buf!r}"
        buf += data
    head, _, buf = buf.partition(b"\r\n\r\n")
    pieces = []
    while time.monotonic() < deadline:
        nl = buf.find(b"\r\n")
        if nl >= 0:
            size = int(buf[:nl], 16)
            if size == 0 and len(buf) >= nl + 4:
                return head, pieces, True
            if size and len(buf) >= nl + 2 + size + 2:
                pieces.append(buf[nl + 2:nl + 2 + size])
                buf = buf[nl + 2 + size + 2:]
                continue
        data = sock.recv(65536)
        if not data:
            return head, pieces, False
        buf += data
    raise AssertionError(f"no end of the answer in time; read {pieces!r}")


def test_streams_keep_their_connection_and_one_cut_short_is_not_passed_off_as_complete(cluster):
    """Streams are written to the client's socket by the gateway itself (gateway.upstream.relay): answers on
    one keep-alive connection follow each other, each with one X-Request-Id; a stream whose engine
    dies under it, when it cannot resume on another replica, ends with an error event and the
    connection closed, not with the chunk that says the answer is whole."""
    import socket

    cluster.start_redis()
    engine = start_process(cluster.procs, "engine", base=0.3, tokens=4, max_seqs=8)
    publish(cluster, {"e1": engine})
    gw = cluster.start_gateway()
    host, port = gw.split("//")[1].split(":")
    body = b'{"model": "m", "stream": true}'
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
               b"X-Request-Id: r1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        for _ in range(3):
            sock.sendall(request)
            head, pieces, whole = _read_answer(sock, time.monotonic() + 20)
            assert whole and head.startswith(b"HTTP/1.1 200") and b"Connection: keep-alive" in head
            assert head.lower().count(b"x-request-id: r1") == 1
            assert b"".join(pieces).endswith(b"data: [DONE]\n\n")

    slow = start_process(cluster.procs, "slow-engine", base=30.0, tokens=30, max_seqs=8)
    publish(cluster, {"e2": slow})
    store = cluster.store()
    wait_until(lambda: all(r.version == store.endpoints_version() for r in store.gateway_reports()), 10,
               what="the gateway to load the list with only the slow engine")
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        sock.sendall(request)
        buf = b""
        while b"data:" not in buf:  # the first event is through: the gateway is relaying
            data = sock.recv(65536)
            assert data, buf
            buf += data
        cluster.procs.get("slow-engine").kill9()
        rest = b""
        while data := sock.recv(65536):  # the gateway closes the connection (a timeout fails the test)
            rest += data
    assert not (buf + rest).endswith(b"0\r\n\r\n"), "a cut stream must not end like a complete one"
    # ... and says why in an error event, since it could not be continued (gateway.http.resume)
    assert b'data: {"error": {"message": "the engine stopped mid-answer' in rest


def test_workers_count_each_others_requests_against_capacity(cluster):
    """Two workers, one endpoint with capacity 2, no scrapes at all: the workers see each other's
    requests through the shared table (gateway.server.siblings), so the engine never holds more than two
    while the rest wait in the gateway's queues, and every request is answered once slots free.
    Each worker is sent four requests of its own, on kept-alive connections whose worker the test
    knows (the pid /healthz answers on them): the kernel hands a new connection to any worker."""
    import http.client
    import json

    from tests.integration.test_gateway_routing import metric

    cluster.start_redis()
    engine = start_process(cluster.procs, "engine", base=0.05, tokens=2, max_seqs=16, gate=True)
    publish(cluster, {"e1": engine}, capacity=2)
    gw = cluster.start_gateway(LLMGW_GATEWAY_WORKERS="2")
    store = cluster.store()
    reports = wait_until(lambda: len(r := store.gateway_reports()) == 2 and r, 10,
                         what="a report from each worker")
    each, host, port = 4, "127.0.0.1", int(gw.rsplit(":", 1)[1])
    conns: dict[int, list[http.client.HTTPConnection]] = {r.pid: [] for r in reports}

    def one_more_connection() -> bool:
        """Open a connection and keep it if its worker has fewer than `each`; True once all have."""
        c = http.client.HTTPConnection(host, port, timeout=60)
        c.request("GET", "/healthz")
        pid = json.loads(c.getresponse().read())["pid"]
        if len(conns[pid]) < each:
            conns[pid].append(c)
        else:
            c.close()
        return all(len(cs) == each for cs in conns.values())

    def answered(c: http.client.HTTPConnection) -> int:
        resp = c.getresponse()
        resp.read()  # the whole stream
        return resp.status

    pool = ThreadPoolExecutor(2 * each)
    try:
        wait_until(one_more_connection, 30, interval=0, what=f"{each} connections to each worker")
        body = json.dumps({"model": "m", "stream": True})
        for c in (c for cs in conns.values() for c in cs):
            c.request("POST", CHAT, body, headers={"Content-Type": "application/json"})
        futs = [pool.submit(answered, c) for cs in conns.values() for c in cs]
        n = len(futs)
        text = lambda: requests.get(gw + "/metrics", timeout=5).text  # noqa: E731
        seen = {}

        def queued() -> bool:
            seen["queued"] = metric(text(), 'llmgw_gateway_queue_length{model="m"}')
            seen["at the engine"] = requests.get(engine + "/stats", timeout=5).json()["open"]
            return seen["queued"] == n - 2

        try:
            wait_until(queued, 20, what=f"{n - 2} requests queued in the gateway")
        except AssertionError as e:
            raise AssertionError(f"{e}; last seen: {seen}") from None
        assert requests.get(engine + "/stats", timeout=5).json()["open"] == 2
        requests.post(engine + "/gate", timeout=5)
        assert [f.result() for f in futs] == [200] * n
        # Both workers took requests (else this would not test them together), and yet at most two
        # were at the engine at once.
        wait_until(lambda: [bool("m" in r.models and r.models["m"].last_request_at) for r in store.gateway_reports()]
                   == [True, True], 15, what="both workers to report a request")
        assert requests.get(engine + "/stats", timeout=5).json()["max_open"] == 2
    finally:
        requests.post(engine + "/gate", timeout=5)  # a failed test must not leave streams held
        pool.shutdown(wait=True)
        for c in (c for cs in conns.values() for c in cs):
            c.close()
