"""Security (issue 15, bad input), on real processes:

- The gateway connects only to endpoints of the published list, whatever a request says: model names
  that are URLs or paths, absolute request targets, Host, Forwarded and X-Forwarded-* headers. A canary
  socket listens where such a request points; it must never get a connection.
- API keys exist only as hashes at rest: after `llmgw keys create`, no Redis key or value, nor the
  append-only file, holds the key. The gateway looks a presented key up by its SHA-256 digest and never
  compares the key itself (so comparison timing can tell an attacker nothing about a stored key).
- Engines bind to the node's configured address (LLMGW_ENGINE_HOST), not to every interface: read from
  /proc (the engine process's own listening sockets).
- REDIS_URL with a password, and with a password and TLS (`rediss://`, certificates made here with the
  openssl command), works for every process: control worker, beat, agent, gateway and Flower.
"""

from __future__ import annotations

import json
import os
import shutil
import socket

import pytest
import requests

from gateway.keys.table import KeyTable
from gateway.observe.health import RedisHealth
from llmgw.state.keypolicy import hash_key
from llmgw.state.clock import Clock
from tests.faults.fleet import AGENT, engines
from tests.faults.rawhttp import RawGateway
from harness import needs
from harness.cluster import make_certs, sim_catalog
from harness.procs import TOKEN_VAR, free_port, socket_inodes, wait_until

pytestmark = [pytest.mark.faults, pytest.mark.slow]

ENGINE_HOST = "127.0.0.2"  # a loopback address of its own: "bound to it only" is then visible in /proc
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def body(model: object, **extra) -> bytes:
    return json.dumps({"model": model, **CHAT, **extra}).encode()


def serve_one(cluster, redis: dict | None = None, **node_env: str) -> str:
    """Redis (`redis`: its options), one node, control, beat, a gateway and one routed sim replica of `chat`."""
    [url] = cluster.start_system(sim_catalog(), redis=redis, node_env={**AGENT, **node_env}, routed=1)
    return url


@pytest.fixture
def canary():
    """A listening socket that nothing of llmgw's may ever connect to."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(64)
    yield s
    s.close()


def connections(s: socket.socket) -> int:
    """Connections the kernel completed on `s` (each waits in its accept queue, closed or not)."""
    s.setblocking(False)
    n = 0
    while True:
        try:
            conn, _ = s.accept()
        except BlockingIOError:
            return n
        conn.close()
        n += 1


def test_gateway_connects_only_to_published_endpoints(cluster, canary):
    url = serve_one(cluster, LLMGW_ENGINE_HOST=ENGINE_HOST, LLMGW_NODE_ADDRESS=ENGINE_HOST)
    gw = RawGateway(url)
    there = f"127.0.0.1:{canary.getsockname()[1]}"
    # Model names that name somewhere else: refused as unknown models, never dialled.
    for model in (f"http://{there}/x", f"http://{there}", there, f"//{there}/v1", "../x", "..%2f..%2fx",
                  "%2e%2e/", "%2e%2e%2f", "chat/../x", "../chat", "chat/../../x", f"chat@{there}",
                  f"chat#{there}", "/etc/passwd", "file:///etc/passwd", f"chat\r\nHost: {there}"):
        status, _h, answer = gw.post("/v1/chat/completions", body(model))
        assert status == 404 and b"model_not_found" in answer, (model, status, answer)
    # previous_response_id and response ids in the path lead only to endpoints this gateway issued them for.
    status, _h, answer = gw.post("/v1/responses", json.dumps({"model": "chat", "input": "hi",
                                                               "previous_response_id": f"http://{there}/x"}).encode())
    assert status == 404, answer
    for rid in (f"http:%2f%2f{there}", "..%2f..%2fx", "%2e%2e", f"resp_{there}"):
        status, _h, answer = gw.exchange(f"GET /v1/responses/{rid} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
                                         .encode())
        assert status in (400, 404), (rid, status, answer)
    # Where the request says it comes from or is going: served by the published engine, nothing else.
    spoofed = [[(b"Host", there.encode())], [(b"X-Forwarded-Host", there.encode())],
               [(b"X-Forwarded-For", b"127.0.0.1"), (b"X-Forwarded-Proto", b"http"), (b"X-Forwarded-Port",
                                                                                    there.split(":")[1].encode())],
               [(b"Forwarded", f"for=127.0.0.1;host={there};proto=http".encode())],
               [(b"X-Original-URL", f"http://{there}/x".encode())], [(b"X-Rewrite-URL", f"http://{there}/".encode())],
               [(b"X-Real-IP", b"127.0.0.1"), (b"X-Forwarded-Server", there.encode())]]
    for headers in spoofed:
        status, _h, answer = gw.post("/v1/chat/completions", body("chat"), headers=headers)
        assert status == 200, (headers, status, answer)
    for target in (f"http://{there}/v1/chat/completions", f"http://{there}/x"):  # absolute-form request targets
        status, _h, answer = gw.post(target, body("chat"), headers=[(b"Host", there.encode())])
        assert status in (200, 404), (target, status, answer)
    assert connections(canary) == 0, "the gateway connected to an address no published endpoint has"


def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every socket `pid` listens on, from its fds and its network namespace's tables."""
    inodes = socket_inodes(pid)
    out = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        with open(f"/proc/{pid}/net/{table}") as f:
            next(f)
            for line in f:
                cols = line.split()
                addr, port = cols[1].split(":")
                if cols[3] == "0A" and cols[9] in inodes:  # LISTEN, and this process's socket
                    if width == 8:
                        host = ".".join(str(int(addr[i:i + 2], 16)) for i in (6, 4, 2, 0))
                    else:
                        host = "[::]" if int(addr, 16) == 0 else f"ipv6:{addr}"
                    out.append((host, int(port, 16)))
    return out


def test_engines_bind_the_nodes_configured_address_only(cluster):
    url = serve_one(cluster, LLMGW_ENGINE_HOST=ENGINE_HOST, LLMGW_NODE_ADDRESS=ENGINE_HOST)
    [rec] = cluster.store().all_replicas()
    [pid] = engines(os.environ[TOKEN_VAR])
    assert pid == rec.engine_pid
    assert listening(pid) == [(ENGINE_HOST, rec.port)], listening(pid)
    assert rec.url == f"http://{ENGINE_HOST}:{rec.port}"
    with socket.socket() as s:  # not on 127.0.0.1, nor any other address of the machine
        assert s.connect_ex(("127.0.0.1", rec.port)) != 0
    r = requests.post(url + "/v1/chat/completions", data=body("chat"), timeout=30,
                      headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text


class Spy(str):
    """A presented key that counts every comparison made with it."""

    compared = 0

    def __eq__(self, other):
        Spy.compared += 1
        return str.__eq__(self, other)

    def __ne__(self, other):
        Spy.compared += 1
        return str.__ne__(self, other)

    __hash__ = str.__hash__


def redis_dump(r) -> str:
    """Every key name and value in Redis, as one text."""
    out = []
    for k in r.scan_iter("*"):
        t = r.type(k)
        value = {"string": r.get, "hash": r.hgetall, "list": lambda x: r.lrange(x, 0, -1), "set": r.smembers,
                 "zset": lambda x: r.zrange(x, 0, -1, withscores=True),
                 "stream": lambda x: r.xrange(x)}.get(t, lambda x: None)(k)
        out.append(f"{k} {t} {value!r}")
    return "\n".join(out)


def test_api_keys_are_hashes_at_rest_and_looked_up_by_digest(cluster):
    url = serve_one(cluster, redis={"persistent": True})
    key = cluster.llmgw("keys", "create", "team").stdout.strip()
    key_id = json.loads(cluster.llmgw("keys", "list", "--json").stdout)[0]["id"]
    assert len(key) >= 20 and key_id not in key
    r = cluster.redis()
    dump = redis_dump(r)
    assert key_id in dump and hash_key(key) in dump  # the record is there, by its hash
    assert key not in dump, "the plaintext API key is stored in Redis"
    aof = b"".join(p.read_bytes() for p in (cluster.root / "redis").rglob("*") if p.is_file())
    assert key_id.encode() in aof and key.encode() not in aof, "the append-only file holds the plaintext key"

    # The gateway: served with the key, 401 with a key one character off (same length, same prefix).
    good = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    wait_until(lambda: requests.post(url + "/v1/chat/completions", data=body("chat"), timeout=30,
                                     headers={"Content-Type": "application/json"}).status_code == 401, 20,
               what="the gateway to require the new key")
    assert requests.post(url + "/v1/chat/completions", data=body("chat"), headers=good, timeout=30).status_code == 200
    near = key[:-1] + ("A" if key[-1] != "A" else "B")
    assert requests.post(url + "/v1/chat/completions", data=body("chat"), timeout=30,
                         headers={**good, "Authorization": f"Bearer {near}"}).status_code == 401

    # The lookup the gateway does (gateway.keys.table.KeyTable) on the table in this Redis: by digest only.
    table = KeyTable(cluster.store(), RedisHealth(Clock()))
    table.refresh()
    assert set(table.by_hash) == {hash_key(key)}
    Spy.compared = 0
    found = table.lookup(Spy(key))
    assert found is not None and found.id == key_id
    assert table.lookup(Spy(near)) is None
    assert Spy.compared == 0, "the presented key was compared itself, not its digest"


@pytest.mark.parametrize("tls", [False, True], ids=["password", "password+tls"])
def test_redis_with_password_and_tls_for_every_process(cluster, tmp_path, tls):
    if tls:
        needs.openssl()
    certs = tmp_path / "certs"
    certs.mkdir()
    try:
        cluster.start_redis(password="s3cret pass/with:odd@chars", tls=make_certs(certs) if tls else None)
        assert cluster.redis_url.startswith("rediss://" if tls else "redis://:")
        url = serve_one(cluster)  # on the Redis just started
        r = requests.post(url + "/v1/chat/completions", data=body("chat"), timeout=30,
                          headers={"Content-Type": "application/json"})
        assert r.status_code == 200, r.text
        assert cluster.llmgw("status").returncode == 0

        port = free_port()
        cluster.start_flower(port, FLOWER_UNAUTHENTICATED_API="true")

        def workers() -> set[str]:
            try:
                resp = requests.get(f"http://127.0.0.1:{port}/api/workers?refresh=1", timeout=10)
            except requests.ConnectionError:
                return set()
            return {w.split("@")[0] for w in resp.json()} if resp.status_code == 200 else set()

        wait_until(lambda: {"control", "a"} <= workers(), 60, interval=0.5, what="Flower to see the workers")
    finally:
        cluster.stop()
        shutil.rmtree(certs, ignore_errors=True)
