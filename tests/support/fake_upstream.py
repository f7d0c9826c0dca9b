"""A minimal OpenAI-compatible fake engine for gateway tests and benchmarks.

    python -m tests.support.fake_upstream --port P [--speed 1] [--max-seqs 4] [--base 0.05]
                                          [--fail-status 503] [--name NAME]

Each request holds one of `max-seqs` slots for `base / speed` seconds (requests beyond the slots
queue), like a batch engine: latency is flat until the slots are full, then grows. Streams send
`--tokens` chunks spread over that time, then a usage chunk when `stream_options.include_usage` is
set, then `[DONE]`. GET /stats tells what it saw (requests, open streams, streams the client cut).
Also usable in-process: `FakeUpstream(...).start()` / `.stop()`.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # a benchmark opens many connections at once


class FakeUpstream:
    def __init__(self, host: str = "127.0.0.1", port: int = 0, speed: float = 1.0, max_seqs: int = 4,
                 base: float = 0.05, tokens: int = 8, fail_status: int = 0, name: str = "fake"):
        self.speed, self.base, self.tokens = speed, base, tokens
        self.fail_status, self.name = fail_status, name
        self.slots = threading.BoundedSemaphore(max_seqs)
        self.lock = threading.Lock()
        self.stats = {"requests": 0, "active": 0, "waiting": 0, "cancelled": 0, "completed": 0,
                      "models_seen": [], "request_ids": []}
        self.server = _Server((host, port), self._handler())
        self.port = self.server.server_address[1]
        self.url = f"http://{host}:{self.port}"
        self.thread: threading.Thread | None = None

    def start(self) -> "FakeUpstream":
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _bump(self, k: str, n: int = 1) -> None:
        with self.lock:
            self.stats[k] += n

    def _handler(self):
        fake = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers and body go out in separate writes

            def log_message(self, *a):  # quiet
                pass

            def _json(self, code: int, obj) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
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
                body = json.loads(self.rfile.read(n) or b"{}")
                with fake.lock:
                    fake.stats["requests"] += 1
                    fake.stats["models_seen"].append(body.get("model"))
                    fake.stats["request_ids"].append(self.headers.get("X-Request-Id"))
                    del fake.stats["models_seen"][:-50], fake.stats["request_ids"][:-50]
                if fake.fail_status:
                    return self._json(fake.fail_status, {"error": {"message": "failing on purpose"}})
                if self.path.endswith("/embeddings"):
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
                        time.sleep(fake.base / fake.speed)
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
                try:
                    for i in range(fake.tokens):
                        time.sleep(step)
                        ev = {"id": "c", "object": "chat.completion.chunk", "model": body.get("model"),
                              "choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}]}
                        self._chunk(b"data: " + json.dumps(ev).encode() + b"\n\n")
                    if (body.get("stream_options") or {}).get("include_usage"):
                        ev = {"id": "c", "object": "chat.completion.chunk", "model": body.get("model"), "choices": [],
                              "usage": {"prompt_tokens": 5, "completion_tokens": fake.tokens,
                                        "total_tokens": 5 + fake.tokens}}
                        self._chunk(b"data: " + json.dumps(ev).encode() + b"\n\n")
                    self._chunk(b"data: [DONE]\n\n")
                    self._chunk(b"")
                    fake._bump("completed")
                except (BrokenPipeError, ConnectionResetError):
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
    a = ap.parse_args()
    f = FakeUpstream(a.host, a.port, a.speed, a.max_seqs, a.base, a.tokens, a.fail_status, a.name)
    try:
        f.server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()


def start_process(procs, name: str, **kw) -> str:
    """Start a fake engine as a process of `procs` (a tests.support.procs.ProcessSet); returns its URL
    once /health answers. kw: speed, max_seqs, base, tokens, fail_status."""
    import sys

    import requests

    from tests.support.procs import free_port, wait_until

    port = free_port()
    argv = [sys.executable, "-m", "tests.support.fake_upstream", "--port", str(port)]
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    procs.start(name, argv)
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: requests.get(url + "/health", timeout=1).ok, 15, what=f"fake engine {name}")
    return url
