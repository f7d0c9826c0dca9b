"""A minimal OpenAI-compatible fake engine for gateway tests and benchmarks.

    python -m tests.support.fake_upstream --port P [--speed 1] [--max-seqs 4] [--base 0.05]
                                          [--fail-status 503] [--name NAME] [--gate] [--require-key K]

Each request holds one of `max-seqs` slots for `base / speed` seconds (requests beyond the slots
queue), like a batch engine: latency is flat until the slots are full, then grows. Streams send
`--tokens` chunks spread over that time (the first at once), then a usage chunk when `stream_options.include_usage` is
set, then `[DONE]`. GET /stats tells what it saw (requests, open streams, streams the client cut, the
Authorization headers it got,
`open`/`max_open`: requests received and not yet answered, now and at most at once). With `--gate`
every request, once in its slot, is held until `POST /gate` opens the gate (tests that need a
request to stay busy for as long as they look at it, however slow the machine). `/stats` also lists the
`Authorization` header of the last requests (`authorization`, None when absent); with `--require-key`
requests and `GET /v1/models` without `Bearer <that key>` get 401 (a hosted API). In-process only:
`fail_body` (bytes) is the body a `fail_status` answer carries, as `fail_type` (an engine's own error
dialect), and `headers` are added to every JSON answer (llama-server's empty `Access-Control-Allow-Origin`).
Also usable in-process: `FakeUpstream(...).start()` / `.stop()`; `stop()` interrupts held and
sleeping requests, closes open connections and joins every thread.
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class _Server(ThreadingHTTPServer):
    # Handler threads are joined by server_close() (FakeUpstream.stop), so none outlives its test.
    daemon_threads = False
    block_on_close = True
    request_queue_size = 1024  # a benchmark opens many connections at once
    stopping: threading.Event | None = None

    def handle_error(self, request, client_address):
        if self.stopping is not None and self.stopping.is_set():
            return  # a connection cut by stop(): expected, not worth a traceback
        super().handle_error(request, client_address)


class FakeUpstream:
    def __init__(self, host: str = "127.0.0.1", port: int = 0, speed: float = 1.0, max_seqs: int = 4,
                 base: float = 0.05, tokens: int = 8, fail_status: int = 0, name: str = "fake",
                 gate: bool = False, require_key: str | None = None, fail_body: bytes | None = None,
                 fail_type: str = "application/json", headers: tuple[tuple[str, str], ...] = ()):
        self.speed, self.base, self.tokens = speed, base, tokens
        self.fail_body, self.fail_type, self.headers = fail_body, fail_type, headers
        self.require_key = require_key
        self.fail_status, self.name = fail_status, name
        self.slots = threading.BoundedSemaphore(max_seqs)
        self.lock = threading.Lock()
        self.stats = {"requests": 0, "active": 0, "waiting": 0, "cancelled": 0, "completed": 0,
                      "open": 0, "max_open": 0, "models_seen": [], "request_ids": [],
                      "authorization": []}
        # Every wait (simulated work, the gate) is on `stopping`, so stop() ends it at once.
        self.stopping = threading.Event()
        self.gate = threading.Event()
        if not gate:
            self.gate.set()
        self.conns: set[socket.socket] = set()
        self.server = _Server((host, port), self._handler())
        self.server.stopping = self.stopping
        self.port = self.server.server_address[1]
        self.url = f"http://{host}:{self.port}"
        self.thread: threading.Thread | None = None

    def start(self) -> "FakeUpstream":
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,),
                                       name=f"fake-upstream-{self.name}")
        self.thread.start()
        return self

    def open_gate(self) -> None:
        self.gate.set()

    def stop(self) -> None:
        """Stop serving: end held and sleeping requests, cut kept-alive connections (a handler blocked
        reading the next request would otherwise never end), then join the serving and handler threads."""
        self.stopping.set()
        if self.thread is not None:
            self.server.shutdown()  # returns once serve_forever has left its loop
            self.thread.join()
        with self.lock:
            conns = list(self.conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed by its handler
        self.server.server_close()  # joins every handler thread (block_on_close)

    def _hold(self, seconds: float) -> bool:
        """Simulated work: wait for the gate, then `seconds`; False when stop() interrupted it."""
        while not self.gate.is_set():
            if self.stopping.wait(0.02):
                return False
        return not self.stopping.wait(seconds)

    def _answered(self) -> None:
        """Called just before a request's last bytes go out: once the client has its answer, `open`
        no longer counts it (so a client sending its next request right away never overlaps)."""
        self._bump("open", -1)

    def _bump(self, k: str, n: int = 1) -> None:
        with self.lock:
            self.stats[k] += n

    def _handler(self):
        fake = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers and body go out in separate writes

            def setup(self):
                super().setup()
                with fake.lock:
                    fake.conns.add(self.connection)
                if fake.stopping.is_set():  # accepted while stop() was cutting the others
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)

            def finish(self):
                with fake.lock:
                    fake.conns.discard(self.connection)
                try:
                    super().finish()
                except OSError:
                    pass  # the connection was cut (stop(), or the client left)

            def log_message(self, *a):  # quiet
                pass

            def _json(self, code: int, obj, data: bytes | None = None, ctype: str = "application/json") -> None:
                data = json.dumps(obj).encode() if data is None else data
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                for name, value in fake.headers:
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

            def _refused(self) -> bool:
                if fake.require_key and self.headers.get("Authorization") != f"Bearer {fake.require_key}":
                    self._json(401, {"error": {"message": "missing or wrong API key"}})
                    return True
                return False

            def do_GET(self):
                if self.path == "/v1/models":
                    if not self._refused():
                        self._json(200, {"object": "list", "data": [{"id": fake.name, "max_model_len": 4096}]})
                    return
                if self.path == "/health":
                    return self._json(200, {"ok": True})
                if self.path == "/stats":
                    with fake.lock:
                        return self._json(200, dict(fake.stats))
                if self.path == "/metrics":
                    text = (f"vllm:num_requests_running {fake.stats['active']}\n"
                            f"vllm:num_requests_waiting {fake.stats['waiting']}\n").encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "text/plain")
                    self.send_header("Content-Length", str(len(text)))
                    self.end_headers()
                    self.wfile.write(text)
                    return
                self._json(404, {"error": {"message": "not found"}})

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n) or b"{}"
                form = re.search(rb'name="model"\r\n\r\n([^\r]*)', raw)  # a multipart form's model field
                body = {"model": form.group(1).decode()} if form else json.loads(raw)
                if self.path == "/gate":  # a control call, not a request
                    fake.open_gate()
                    return self._json(200, {"gate": "open"})
                with fake.lock:
                    fake.stats["requests"] += 1
                    fake.stats["open"] += 1
                    fake.stats["max_open"] = max(fake.stats["max_open"], fake.stats["open"])
                    fake.stats["models_seen"].append(body.get("model"))
                    fake.stats["request_ids"].append(self.headers.get("X-Request-Id"))
                    fake.stats["authorization"].append(self.headers.get("Authorization"))
                    del fake.stats["models_seen"][:-50], fake.stats["request_ids"][:-50]
                    del fake.stats["authorization"][:-50]
                if self._refused():
                    fake._answered()
                    return
                if fake.fail_status:
                    fake._answered()
                    return self._json(fake.fail_status, {"error": {"message": "failing on purpose"}},
                                      fake.fail_body, fake.fail_type)
                if self.path.endswith("/transcriptions"):
                    fake._answered()
                    return self._json(200, {"text": f"heard by {fake.name}"})
                if self.path.endswith("/embeddings"):
                    fake._answered()
                    return self._json(200, {"object": "list", "data": [{"embedding": [0.0, 1.0], "index": 0}],
                                            "usage": {"prompt_tokens": 3, "total_tokens": 3}})
                fake._bump("waiting")
                fake.slots.acquire()
                fake._bump("waiting", -1)
                fake._bump("active")
                try:
                    if body.get("stream"):
                        self._stream(body)
                    else:
                        if not fake._hold(fake.base / fake.speed):
                            fake._answered()
                            self.close_connection = True
                            return
                        fake._answered()
                        self._json(200, {
                            "id": "cmpl-1", "object": "chat.completion", "model": body.get("model"),
                            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi " * fake.tokens},
                                         "finish_reason": "stop"}],
                            "usage": {"prompt_tokens": 5, "completion_tokens": fake.tokens,
                                      "total_tokens": 5 + fake.tokens},
                        })
                        fake._bump("completed")
                finally:
                    fake._bump("active", -1)
                    fake.slots.release()

            def _chunk(self, data: bytes) -> None:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()

            def _stream(self, body) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                step = fake.base / fake.speed / max(1, fake.tokens)
                answered = False
                try:
                    if not fake._hold(0):
                        raise BrokenPipeError("stopping")
                    # The first event at once (an engine sends its first token right after prefill),
                    # then one every `step`; the answer ends `base / speed` after it began.
                    for i in range(fake.tokens):
                        ev = {"id": "c", "object": "chat.completion.chunk", "model": body.get("model"),
                              "choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}]}
                        self._chunk(b"data: " + json.dumps(ev).encode() + b"\n\n")
                        if not fake._hold(step):
                            raise BrokenPipeError("stopping")
                    if (body.get("stream_options") or {}).get("include_usage"):
                        ev = {"id": "c", "object": "chat.completion.chunk", "model": body.get("model"), "choices": [],
                              "usage": {"prompt_tokens": 5, "completion_tokens": fake.tokens,
                                        "total_tokens": 5 + fake.tokens}}
                        self._chunk(b"data: " + json.dumps(ev).encode() + b"\n\n")
                    self._chunk(b"data: [DONE]\n\n")
                    answered = True
                    fake._answered()
                    self._chunk(b"")
                    fake._bump("completed")
                except (BrokenPipeError, ConnectionResetError):
                    if not answered:
                        fake._answered()
                    fake._bump("cancelled")
                    self.close_connection = True

        return H


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--speed", type=float, default=1.0)
    ap.add_argument("--max-seqs", type=int, default=4)
    ap.add_argument("--base", type=float, default=0.05)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--fail-status", type=int, default=0)
    ap.add_argument("--name", default="fake")
    ap.add_argument("--gate", action="store_true", help="hold every request until POST /gate")
    ap.add_argument("--require-key", default=None, help="answer 401 without Authorization: Bearer <this>")
    a = ap.parse_args()
    f = FakeUpstream(a.host, a.port, a.speed, a.max_seqs, a.base, a.tokens, a.fail_status, a.name, a.gate,
                     a.require_key)
    try:
        f.server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        f.stop()  # its handler threads are not daemons: end them, or the exit would wait on them


if __name__ == "__main__":
    main()


def start_process(procs, name: str, **kw) -> str:
    """Start a fake engine as a process of `procs` (a harness.procs.ProcessSet); returns its URL
    once /health answers. kw: speed, max_seqs, base, tokens, fail_status, gate (True: a bare flag)."""
    import sys

    import requests

    from harness.procs import free_port, wait_until

    port = free_port()
    argv = [sys.executable, "-m", "tests.support.fake_upstream", "--port", str(port)]
    for k, v in kw.items():
        flag = f"--{k.replace('_', '-')}"
        if v is True:
            argv.append(flag)
        elif v is not False:
            argv += [flag, str(v)]
    procs.start(name, argv)
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: requests.get(url + "/health", timeout=1).ok, 15, what=f"fake engine {name}")
    return url
