"""`llmgw up` on a busy host (issue 57). Right after a load test, thousands of sockets of outgoing
connections sit in TIME-WAIT on ports of the kernel's ephemeral range, and each refuses a server's
bind, SO_REUSEADDR or not: `llmgw up` took its ports there and exited with a traceback.

Here the whole stack runs in a network namespace of its own whose ephemeral range
(`net.ipv4.ip_local_port_range` is per namespace) is narrowed to 4,000 ports and kept full of such
TIME-WAIT sockets by a process that connects out and closes first, as a load generator does (the
kernel then has no ephemeral port left to bind: the old `free_port_range` began with exactly that
bind). `llmgw up` starts anyway, its ports from LLMGW_UP_PORT_RANGE below that range, and serves; a
llama-server killed with -9 while another program takes its port restarts on another port, which its
record and the published endpoints then carry, and serves; killed again with its port free, it
restarts in place. Nothing of this touches the host's own ports.

Needs root and `ip` (iproute2): skipped without them, failed under CI (harness/needs.py).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
from pathlib import Path

import pytest

from harness import needs
from harness.procs import ProcessSet, python, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.llamacpp]

ROOT = Path(__file__).resolve().parents[2]
EPHEMERAL = (40000, 43999)  # the namespace's ephemeral range, filled with TIME-WAIT sockets
FILL_TARGET = 39000  # where the filler connects (a listener of its own, outside that range)
GATEWAY = 8080  # the namespace is empty: the README's port is free there
UP_RANGE = (22000, 29999)  # LLMGW_UP_PORT_RANGE's default

# Connects out to its own listener and closes first, until the kernel has no ephemeral port left for
# that destination (EADDRNOTAVAIL: every one is in TIME-WAIT), then keeps it so as TIME-WAITs expire.
FILLER = f"""
import errno, socket, sys, time
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", {FILL_TARGET}))
srv.listen(512)
told = False
while True:
    made = 0
    while True:
        c = socket.socket()
        try:
            c.connect(("127.0.0.1", {FILL_TARGET}))
        except OSError as e:
            c.close()
            if e.errno != errno.EADDRNOTAVAIL:
                raise
            break
        a, _ = srv.accept()
        c.close()  # this side first: its end of the connection stays in TIME-WAIT for 60 s
        a.close()
        made += 1
    if not told:
        print(f"full: {{made}} connections", flush=True)
        told = True
    time.sleep(0.2)
"""

# Takes a port (argv[1]) as another program would, as soon as it is free: a listener, held until killed.
TAKER = """
import socket, sys, time
port = int(sys.argv[1])
deadline = time.monotonic() + 60
while True:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("127.0.0.1", port))
        break
    except OSError:
        s.close()
        if time.monotonic() > deadline:
            sys.exit(f"port {port} never came free")
        time.sleep(0.005)
s.listen()
print(f"took {port}", flush=True)
while True:
    time.sleep(60)
"""

# Inside the namespace: the one replica's record and the published endpoints, as JSON.
READ = """
import json, sys
from llmgw.state.store import Store, connect
store = Store(connect(sys.argv[1]))
(rec,) = store.all_replicas()
print(json.dumps({"rec": rec.to_dict(), "endpoints": [e.url for e in store.read_endpoints().endpoints]}))
"""

# Inside the namespace: a chat completion through the gateway.
CHAT = f"""
import json, requests
s = requests.Session()
s.trust_env = False  # straight to the gateway, whatever proxy the environment names
ask = {{"role": "user", "content": "Say hello"}}
r = s.post("http://127.0.0.1:{GATEWAY}/v1/chat/completions", timeout=60,
           json={{"model": "smollm2", "max_tokens": 4, "messages": [ask]}})
print(json.dumps({{"status": r.status_code, "body": r.json()}}))
"""


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def busy_ns():
    """A network namespace with loopback up, its ephemeral range narrowed to EPHEMERAL and TIME-WAIT
    sockets never reused for new connections (so a full range stays full)."""
    needs.netns()
    ns = f"llmgw-{secrets.token_hex(3)}-busy"
    ip("netns", "add", ns)
    try:
        ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        ip("netns", "exec", ns, "sysctl", "-q", "-w", f"net.ipv4.ip_local_port_range={EPHEMERAL[0]} {EPHEMERAL[1]}",
           "net.ipv4.tcp_tw_reuse=0")
        yield ns
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def in_ns(ns: str, code: str, *args: str) -> dict:
    """Run Python `code` inside the namespace; its one line of JSON."""
    run = subprocess.run(["ip", "netns", "exec", ns, python(), "-c", code, *args], capture_output=True, text=True,
                         timeout=90, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def time_waits(ns: str) -> int:
    out = subprocess.run(["ip", "netns", "exec", ns, "ss", "-Htan", "state", "time-wait"], capture_output=True,
                         text=True, timeout=30).stdout
    return len(out.splitlines())


def test_llmgw_up_on_a_busy_host_starts_and_restarts_its_engine_on_a_free_port(tmp_path, busy_ns,
                                                                              no_leaked_processes):
    ns = busy_ns
    env = {k: v for k, v in os.environ.items()
           if k not in ("REDIS_URL", "LLMGW_REDIS_URL", "LLMGW_STATE_DIR", "LLMGW_PORT_RANGE", "LLMGW_UP_PORT_RANGE")}
    procs = ProcessSet(tmp_path / "logs", env={**env, "PYTHONPATH": str(ROOT)})
    netns = ["ip", "netns", "exec", ns]
    try:
        filler = procs.start("filler", [*netns, python(), "-c", FILLER])
        wait_until(lambda: "full:" in filler.log() or not filler.alive(), 60, what="the ephemeral range to fill")
        assert filler.alive(), filler.log()
        # The kernel has no ephemeral port left to bind: what `free_port_range` used to start from.
        assert time_waits(ns) >= EPHEMERAL[1] - EPHEMERAL[0] + 1 - 10
        bind0 = subprocess.run([*netns, python(), "-c", "import socket; socket.socket().bind(('127.0.0.1', 0))"],
                               capture_output=True, text=True, timeout=30)
        assert bind0.returncode != 0 and "Address already in use" in bind0.stderr, bind0.stderr

        up = procs.start("up", [*netns, python(), "-m", "llmgw", "up", "--port", str(GATEWAY),
                                "--state-dir", str(tmp_path / "state"), "--node", "busy"])
        wait_until(lambda: "ready: the gateway answers" in up.log() or not up.alive(), 240,
                   what="llmgw up to report ready")
        assert up.alive(), up.log()
        assert "Traceback" not in up.log(400) and "llmgw up: warning" not in up.log(400), up.log()
        redis_port = int(re.search(r"started Redis on 127\.0\.0\.1:(\d+)", up.log(400)).group(1))
        redis_url = f"redis://127.0.0.1:{redis_port}/0"
        first = wait_until(lambda: (now := in_ns(ns, READ, redis_url))["rec"]["engine_pid"] and now, 30,
                           what="the engine's pid in its record")
        rec = first["rec"]
        port = rec["port"]
        # Redis on the first port of a block of LLMGW_UP_PORT_RANGE, the engine on the rest of it.
        assert UP_RANGE[0] <= redis_port < port < redis_port + 100 <= UP_RANGE[1] + 1, (redis_port, port)
        assert first["endpoints"] == [f"http://127.0.0.1:{port}"]
        answer = in_ns(ns, CHAT)
        assert answer["status"] == 200 and answer["body"]["usage"]["completion_tokens"] > 0, answer

        # kill -9 the llama-server while another program takes its port: it restarts on another one.
        taker = procs.start("taker", [*netns, python(), "-c", TAKER, str(port)])
        os.kill(rec["engine_pid"], signal.SIGKILL)
        wait_until(lambda: f"took {port}" in taker.log() or not taker.alive(), 30, what="the taker to hold the port")
        assert taker.alive(), taker.log()

        def ready_again(attempt: int) -> dict | None:
            now = in_ns(ns, READ, redis_url)
            r = now["rec"]
            ready = (r["attempt"] == attempt and r["first_ready_at"] and r["first_ready_at"] >= r["started_at"]
                     and r["last_probe_ok"])
            return now if ready and now["endpoints"] == [r["url"]] else None

        second = wait_until(lambda: ready_again(rec["attempt"] + 1), 90,
                            what="the engine Ready again on another port, and published")
        moved = second["rec"]
        assert moved["port"] != port and UP_RANGE[0] <= moved["port"] <= UP_RANGE[1]
        assert moved["url"] == f"http://127.0.0.1:{moved['port']}" and moved["restarts"] == 1
        answer = in_ns(ns, CHAT)
        assert answer["status"] == 200 and answer["body"]["usage"]["completion_tokens"] > 0, answer

        # Killed again with its port free (only its own connections' TIME-WAIT on it): it keeps its port.
        wait_until(lambda: in_ns(ns, READ, redis_url)["rec"]["engine_pid"], 30, what="the engine's pid")
        moved = in_ns(ns, READ, redis_url)["rec"]
        os.kill(moved["engine_pid"], signal.SIGKILL)
        third = wait_until(lambda: ready_again(moved["attempt"] + 1), 90, what="the engine Ready in place")
        assert third["rec"]["port"] == moved["port"] and third["rec"]["restarts"] == 2
        answer = in_ns(ns, CHAT)
        assert answer["status"] == 200, answer
        assert "crash-looping" not in up.log(400)
        # The range was full all along (the filler keeps it so).
        assert filler.alive() and time_waits(ns) >= EPHEMERAL[1] - EPHEMERAL[0] + 1 - 10

        up.signal_group(signal.SIGINT)
        try:
            code = up.popen.wait(60)
        except subprocess.TimeoutExpired:
            pytest.fail("llmgw up did not exit within 60 s of SIGINT:\n" + up.log())
        assert code == 0, up.log()
    finally:
        procs.stop_all()
