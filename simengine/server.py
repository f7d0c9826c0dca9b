"""The simulated engine's HTTP side: an OpenAI-compatible server over the batching model.

One background thread drives `SimCore` with the real clock (plan a step, sleep until its end,
deliver one token to each sequence in the batch); each HTTP request is a thread that submits its
sequence and writes tokens as they arrive (SSE chunks are flushed one by one). Stdlib only:
`ThreadingHTTPServer` with daemon threads holds hundreds of concurrent streams.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import queue
import random
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterator

from simengine import pooling
from simengine import responses as rapi
from simengine.core import Emit, RequestTooLarge, SimConfig, SimCore
from simengine.metrics import MetricsState, Snapshot, render_llamacpp, render_vllm

WORDS = ("the", "model", "answers", "with", "simulated", "tokens", "at", "a", "steady", "rate", "and",
         "every", "word", "is", "one", "token", "so", "counts", "stay", "exact", "for", "tests")


@dataclass(frozen=True)
class ServerOptions:
    host: str
    port: int
    names: tuple[str, ...]
    core: SimConfig = field(default_factory=SimConfig)
    max_tokens_default: int = 16
    metrics_style: str = "vllm"  # or "llamacpp"
    seed: int = 0
    crash_after: int | None = None
    hang_after: int | None = None
    slow_start: float = 0.0
    error_rate: float = 0.0
    log_requests: bool = False
    api_key: str | None = field(default=None, repr=False)
    log_headers: bool = False


def log(msg: str) -> None:
    print(f"simengine: {msg}", file=sys.stderr, flush=True)


# vLLM's AuthenticationMiddleware guards these path prefixes; /health and /metrics stay open.
GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")


def token_digest(token: str) -> str:
    """How --log-headers shows a bearer token: enough to tell which one it was, useless to replay."""
    return "sha256:" + hashlib.sha256(token.encode()).hexdigest()[:16]


def estimate_tokens(text: str) -> int:
    """About four characters per token, at least one: close enough to a real tokenizer for load."""
    return max(1, math.ceil(len(text) / 4))


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def chat_prompt_tokens(messages: list[Any]) -> int:
    # Chat templates add a few tokens per message (role markers) and a couple for the reply header.
    return 2 + sum(4 + estimate_tokens(_content_text(m.get("content"))) for m in messages if isinstance(m, dict))


def whole_answer(q, words) -> str:
    """A non-streamed answer: one word per token event from the batching core, until the last."""
    out = []
    while True:
        e = q.get()
        out.append(next(words))
        if e.done:
            return "".join(out)


class BadRequest(Exception):
    def __init__(self, status: int, message: str, type_: str):
        self.status, self.message, self.type = status, message, type_
        super().__init__(message)


class Engine:
    """Runs the batching model on the real clock in a daemon thread."""

    def __init__(self, config: SimConfig, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        self.core = SimCore(config)
        self.stats = MetricsState(started=time.time())
        self._clock, self._sleep = clock, sleep
        self._cond = threading.Condition()
        self._queues: dict[str, queue.SimpleQueue[Emit]] = {}
        self._stopping = False
        self._frozen = False
        self._thread = threading.Thread(target=self._run, name="sim-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def freeze(self) -> None:
        """Stop making progress for good, while HTTP stays up (a hung EngineCore)."""
        with self._cond:
            self._frozen = True
            self._cond.notify_all()

    def submit(self, prompt_tokens: int, max_tokens: int) -> tuple[str, queue.SimpleQueue[Emit]]:
        rid = uuid.uuid4().hex
        q: queue.SimpleQueue[Emit] = queue.SimpleQueue()
        with self._cond:
            self.core.submit(rid, prompt_tokens, max_tokens, self._clock())
            self._queues[rid] = q
            self._cond.notify_all()
        return rid, q

    def cancel(self, rid: str) -> None:
        with self._cond:
            self.core.cancel(rid)
            self._queues.pop(rid, None)
            self.stats.success["abort"] = self.stats.success.get("abort", 0) + 1

    def finished(self, reason: str) -> None:
        with self._cond:
            self.stats.success[reason] = self.stats.success.get(reason, 0) + 1

    def pooled(self, prompt_tokens: int) -> None:
        """A request that reads its prompt and generates nothing (rerank, score, transcription)
        counts its prompt tokens and one success, as vLLM's pooling requests do."""
        with self._cond:
            self.core.prompt_tokens_total += prompt_tokens
            self.stats.success["stop"] = self.stats.success.get("stop", 0) + 1

    def snapshot(self) -> Snapshot:
        with self._cond:
            s, c = self.stats, self.core
            return Snapshot(
                running=c.num_running, waiting=c.num_waiting, kv_usage=c.kv_usage,
                prompt_tokens_total=c.prompt_tokens_total, generation_tokens_total=c.generation_tokens_total,
                success_total=dict(s.success), ttft=s.ttft.copy(), e2e=s.e2e.copy(), started=s.started,
                busy_seconds_prompt=s.busy_prompt, busy_seconds_decode=s.busy_decode, n_decode_total=s.n_decode,
                max_seq_tokens=c.max_seq_tokens,
            )

    def _run(self) -> None:
        deadline = self._clock()
        while True:
            with self._cond:
                step = None
                while not self._stopping:
                    if not self._frozen:
                        step = self.core.plan_step(self._clock())
                        if step is not None:
                            break
                    self._cond.wait()
                    deadline = self._clock()  # idle time does not count against the next step
                if self._stopping or step is None:
                    return
            # Sleep to an absolute deadline so per-step oversleep does not slow the token rate.
            deadline = max(deadline, self._clock() - 0.05) + step.duration
            delay = deadline - self._clock()
            if delay > 0:
                self._sleep(delay)
            with self._cond:
                emits = self.core.finish_step(step, self._clock())
                self.stats.busy_decode += step.decode
                self.stats.busy_prompt += max(0.0, step.duration - step.decode)  # the step's prefill share
                self.stats.n_decode += 1
                deliveries = []
                for e in emits:
                    if e.ttft is not None:
                        self.stats.ttft.observe(e.ttft)
                    if e.e2e is not None:
                        self.stats.e2e.observe(e.e2e)
                    q = self._queues.pop(e.rid, None) if e.done else self._queues.get(e.rid)
                    if q is not None:
                        deliveries.append((q, e))
            for q, e in deliveries:
                q.put(e)


class SimApp:
    """Per-process state shared by the request handlers (built once in main, no globals)."""

    def __init__(self, opts: ServerOptions):
        self.opts = opts
        self.engine = Engine(opts.core)
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self._rng = random.Random(opts.seed)
        self._requests = 0
        self._answered = 0
        # Which replica answered, in a field every OpenAI client and proxy passes through.
        self.fingerprint = f"llmgw-sim-{opts.port}"
        # A multi-node head's rendezvous (simengine.multinode.Rendezvous); None on one node.
        self.rendezvous: Any = None
        self.responses = rapi.Store()  # what GET/DELETE /v1/responses/{id} and previous_response_id read

    def loading(self) -> bool:
        return self.loading_reason() is not None

    def loading_reason(self) -> str | None:
        """Why the engine cannot serve yet (503), or None once it can."""
        if time.monotonic() - self.started < self.opts.slow_start:
            return "Loading model"
        if self.rendezvous is not None and not self.rendezvous.ready():
            ranks = ", ".join(map(str, self.rendezvous.waiting_for()))
            return f"Waiting for node rank(s) {ranks} of {self.rendezvous.nnodes} to join"
        return None

    def next_request(self) -> tuple[int, bool]:
        """The request's sequence number and whether it should fail (seeded, in arrival order)."""
        with self._lock:
            self._requests += 1
            fail = self.opts.error_rate > 0 and self._rng.random() < self.opts.error_rate
            return self._requests, fail

    def answered(self) -> None:
        with self._lock:
            self._answered += 1
            crash = self.opts.crash_after is not None and self._answered >= self.opts.crash_after
            hang = self.opts.hang_after is not None and self._answered == self.opts.hang_after
        if hang:
            log(f"hanging after {self._answered} requests (--hang-after): HTTP stays up, no tokens")
            self.engine.freeze()
        if crash:
            log(f"crashing after {self._answered} requests (--crash-after)")
            os._exit(1)

    def token_words(self, seq: int) -> Iterator[str]:
        rng = random.Random(f"{self.opts.seed}:{seq}")
        first = True
        while True:
            w = rng.choice(WORDS)
            yield w if first else " " + w
            first = False

    def metrics_text(self) -> str:
        snap = self.engine.snapshot()
        if self.opts.metrics_style == "llamacpp":
            return render_llamacpp(snap)
        return render_vllm(snap, self.opts.names[0])


RESPONSES_PATH = "/v1/responses/"
TRANSCRIPTIONS_PATH = "/v1/audio/transcriptions"
# POST path -> the handler method (vLLM's paths, with and without /v1 where vLLM has both).
POST_ROUTES = {
    "/v1/chat/completions": "_chat", "/v1/completions": "_completion", "/v1/responses": "_responses",
    "/v1/rerank": "_rerank", "/rerank": "_rerank", "/v1/score": "_score", "/score": "_score",
    "/tokenize": "_tokenize", "/detokenize": "_detokenize", TRANSCRIPTIONS_PATH: "_transcribe",
}
GENERATING = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})  # count for --crash-after


def make_handler(app: SimApp) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = 600  # drop idle keep-alive connections of clients that vanished
        server_version = "llmgw-simengine/0.1"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
            if app.opts.log_requests:
                log(f"{self.address_string()} {format % args}")

        # --- plumbing ---------------------------------------------------------------------
        def end_headers(self) -> None:
            # Echo the caller's request id (as vLLM does with --enable-request-id-headers), so a
            # proxy's pass-through is observable.
            rid = self.headers.get("X-Request-Id") if self.headers else None
            if rid:
                self.send_header("X-Request-Id", rid)
            super().end_headers()

        def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _json(self, status: int, obj: Any) -> None:
            self._send(status, json.dumps(obj).encode())

        def _error(self, status: int, message: str, type_: str) -> None:
            self._json(status, {"error": {"message": message, "type": type_, "code": status}})

        def _raw(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                self.close_connection = True
                raise BadRequest(411, "chunked request bodies are not supported; send Content-Length", "BadRequestError")
            try:
                n = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                raise BadRequest(400, "bad Content-Length", "BadRequestError") from None
            return self.rfile.read(n) if n else b""

        def _json_body(self, raw: bytes) -> dict:
            try:
                data = json.loads(raw or b"null")
            except ValueError:
                raise BadRequest(400, "the request body is not valid JSON", "BadRequestError") from None
            if not isinstance(data, dict):
                raise BadRequest(400, "the request body must be a JSON object", "BadRequestError")
            return data

        def _authorized(self, path: str) -> bool:
            """Like vLLM with --api-key: a guarded path needs the bearer token; else 401, answered here."""
            if app.opts.log_headers:
                shown = []
                for name, value in self.headers.items():
                    if name.lower() == "authorization":
                        scheme, space, token = value.partition(" ")
                        value = f"{scheme} {token_digest(token)}" if space else token_digest(value)
                    shown.append(f"{name}: {value}")
                log(f"headers of {self.command} {path}: " + " | ".join(shown))
            key = app.opts.api_key
            if not key or not path.startswith(GUARDED_PREFIXES):
                return True
            scheme, _, token = (self.headers.get("Authorization") or "").partition(" ")
            if scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), key.encode()):
                return True
            self.close_connection = True  # a POST's body was not read
            self._json(401, {"error": {"message": "Unauthorized", "type": "authentication_error", "code": 401}})
            return False

        def _loading(self) -> bool:
            reason = app.loading_reason()
            if reason is not None:
                self._error(503, reason, "unavailable_error")
                return True
            return False

        # --- routes -----------------------------------------------------------------------
        def do_GET(self) -> None:  # noqa: N802 - stdlib name
            path = self.path.split("?", 1)[0]
            if not self._authorized(path):
                return
            if path == "/health":
                if not self._loading():
                    self._json(200, {"status": "ok"})
            elif path == "/metrics":
                self._send(200, app.metrics_text().encode(), "text/plain; version=0.0.4; charset=utf-8")
            elif path.startswith(RESPONSES_PATH):
                found = app.responses.get(path[len(RESPONSES_PATH):])
                if found is None:
                    self._error(404, f"Response with id '{path[len(RESPONSES_PATH):]}' not found.", "NotFoundError")
                else:
                    self._json(200, found)
            elif path == "/v1/models":
                if not self._loading():
                    created = int(time.time())
                    self._json(200, {"object": "list", "data": [
                        {"id": n, "object": "model", "created": created, "owned_by": "llmgw-sim",
                         "root": app.opts.names[0], "parent": None,
                         "max_model_len": app.opts.core.kv_tokens} for n in app.opts.names]})
            else:
                self._error(404, f"no route {path}", "NotFoundError")

        def do_DELETE(self) -> None:  # noqa: N802 - stdlib name
            path = self.path.split("?", 1)[0]
            if not path.startswith(RESPONSES_PATH):
                self._error(404, f"no route {path}", "NotFoundError")
            elif app.responses.delete(path[len(RESPONSES_PATH):]):
                self._json(200, {"id": path[len(RESPONSES_PATH):], "object": "response", "deleted": True})
            else:
                self._error(404, f"Response with id '{path[len(RESPONSES_PATH):]}' not found.", "NotFoundError")

        def do_POST(self) -> None:  # noqa: N802 - stdlib name
            path = self.path.split("?", 1)[0]
            if not self._authorized(path):
                return
            handler = POST_ROUTES.get(path)
            if handler is None:
                self.close_connection = True  # its body was not read: the connection cannot be reused
                self._error(404, f"no route {path}", "NotFoundError")
                return
            try:
                raw = self._raw()
                body = self._json_body(raw) if path != TRANSCRIPTIONS_PATH else {}
            except BadRequest as e:
                self._error(e.status, e.message, e.type)
                return
            if self._loading():
                return
            generates = path in GENERATING
            try:
                if path == TRANSCRIPTIONS_PATH:
                    self._transcribe(raw)
                else:
                    getattr(self, handler)(body)
            except BadRequest as e:
                self._error(e.status, e.message, e.type)
            finally:
                if generates:
                    app.answered()

        def _chat(self, body: dict) -> None:
            self._complete(True, body)

        def _completion(self, body: dict) -> None:
            self._complete(False, body)

        def _model(self, body: dict) -> str:
            model = body.get("model") or app.opts.names[0]
            if model not in app.opts.names:
                raise BadRequest(404, f"The model `{model}` does not exist.", "NotFoundError")
            return model

        def _rerank(self, body: dict) -> None:
            model = self._model(body)
            query, docs, top_n = body.get("query"), body.get("documents"), body.get("top_n")
            if not isinstance(query, str) or not isinstance(docs, list):
                raise BadRequest(400, "query must be a string and documents a list", "BadRequestError")
            if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 0):
                raise BadRequest(400, "top_n must be a non-negative integer", "BadRequestError")
            answer, tokens = pooling.rerank(model, query, docs, top_n)
            app.engine.pooled(tokens)
            self._json(200, answer)

        def _score(self, body: dict) -> None:
            model = self._model(body)
            a, b = body.get("text_1"), body.get("text_2")
            if a is None or b is None:
                raise BadRequest(400, "text_1 and text_2 are required", "BadRequestError")
            answer, tokens = pooling.score(model, a, b, int(time.time()))
            app.engine.pooled(tokens)
            self._json(200, answer)

        def _tokenize(self, body: dict) -> None:
            model = self._model(body)
            if isinstance(body.get("messages"), list):
                text = " ".join(_content_text(m.get("content")) for m in body["messages"] if isinstance(m, dict))
            elif isinstance(body.get("prompt"), str):
                text = body["prompt"]
            else:
                raise BadRequest(400, "prompt (a string) or messages is required", "BadRequestError")
            tokens = pooling.tokenize(text)
            self._json(200, {"count": len(tokens), "max_model_len": app.opts.core.kv_tokens, "tokens": tokens,
                             "model": model})

        def _detokenize(self, body: dict) -> None:
            self._model(body)
            tokens = body.get("tokens")
            if not isinstance(tokens, list) or not all(isinstance(t, int) and t > 0 for t in tokens):
                raise BadRequest(400, "tokens must be a list of positive integers", "BadRequestError")
            self._json(200, {"prompt": pooling.detokenize(tokens)})

        def _transcribe(self, raw: bytes) -> None:
            try:
                fields = pooling.form_fields(self.headers.get("Content-Type", ""), raw)
            except ValueError as e:
                raise BadRequest(400, str(e), "BadRequestError") from None
            self._model({"model": fields.get("model") if isinstance(fields.get("model"), str) else None})
            audio = fields.get("file")
            if not isinstance(audio, bytes):
                raise BadRequest(400, "the form needs a `file` with the audio", "BadRequestError")
            app.engine.pooled(max(1, len(audio) // 1000))
            self._json(200, {"text": pooling.TRANSCRIPT})

        def _responses(self, body: dict) -> None:
            model = self._model(body)
            text = rapi.input_text(body.get("input"))
            if text is None:
                raise BadRequest(400, "input must be a string or a list of messages", "BadRequestError")
            prompt = estimate_tokens(text)
            if isinstance(body.get("instructions"), str):
                prompt += estimate_tokens(body["instructions"])
            previous = body.get("previous_response_id")
            if previous is not None:
                earlier = app.responses.get(previous) if isinstance(previous, str) else None
                if earlier is None:
                    raise BadRequest(404, f"Response with id '{previous}' not found.", "NotFoundError")
                prompt += earlier["usage"]["total_tokens"]  # the conversation so far is part of the prompt
            mt = body.get("max_output_tokens")
            explicit = mt is not None
            mt = app.opts.max_tokens_default if mt is None else mt
            if isinstance(mt, bool) or not isinstance(mt, int) or mt < 1:
                raise BadRequest(400, "max_output_tokens must be a positive integer", "BadRequestError")
            seq, fail = app.next_request()
            if fail:
                raise BadRequest(500, "simulated engine error (--error-rate)", "InternalServerError")
            try:
                core_id, q = app.engine.submit(prompt, mt)
            except RequestTooLarge as e:
                raise BadRequest(400, str(e), "BadRequestError") from None
            rid, msg_id = rapi.new_ids()
            created, words = int(time.time()), app.token_words(seq)
            finish = "length" if explicit else "stop"
            keep = body.get("store", True) is not False

            def final(out: str) -> dict:
                return rapi.response(rid, msg_id, model, created, "completed", out, previous,
                                     rapi.usage(prompt, mt), body.get("max_output_tokens"))

            if not body.get("stream"):
                text = whole_answer(q, words)
                app.engine.finished(finish)
                resp = final(text)
                if keep:
                    app.responses.put(resp)
                self._json(200, resp)
                return
            ev = rapi.Events()
            started = rapi.response(rid, msg_id, model, created, "in_progress", "", previous, None,
                                    body.get("max_output_tokens"))
            try:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream; charset=utf-8")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                self._write_chunk(ev.frame("response.created", response=started))
                self._write_chunk(ev.frame("response.in_progress", response=started))
                self._write_chunk(ev.frame("response.output_item.added", output_index=0,
                                           item=rapi.message(msg_id, "", "in_progress")))
                part = {"type": "output_text", "text": "", "annotations": []}
                self._write_chunk(ev.frame("response.content_part.added", item_id=msg_id, output_index=0,
                                           content_index=0, part=part))
                out = []
                while True:
                    e = q.get()
                    w = next(words)
                    out.append(w)
                    self._write_chunk(ev.frame("response.output_text.delta", item_id=msg_id, output_index=0,
                                               content_index=0, delta=w, logprobs=[]))
                    if e.done:
                        break
                app.engine.finished(finish)
                resp = final("".join(out))
                if keep:
                    app.responses.put(resp)
                done_text = resp["output"][0]["content"][0]
                self._write_chunk(ev.frame("response.output_text.done", item_id=msg_id, output_index=0,
                                           content_index=0, text=done_text["text"], logprobs=[]))
                self._write_chunk(ev.frame("response.content_part.done", item_id=msg_id, output_index=0,
                                           content_index=0, part=done_text))
                self._write_chunk(ev.frame("response.output_item.done", output_index=0, item=resp["output"][0]))
                self._write_chunk(ev.frame("response.completed", response=resp))
                self._write_chunk(b"")  # end of chunked body
            except (BrokenPipeError, ConnectionResetError, TimeoutError, OSError):
                app.engine.cancel(core_id)
                self.close_connection = True

        def _complete(self, chat: bool, body: dict) -> None:
            try:
                model, prompt_tokens, max_tokens, explicit = self._parse(chat, body)
            except BadRequest as e:
                self._error(e.status, e.message, e.type)
                return
            seq, fail = app.next_request()
            if fail:
                self._error(500, "simulated engine error (--error-rate)", "InternalServerError")
                return
            try:
                rid, q = app.engine.submit(prompt_tokens, max_tokens)
            except RequestTooLarge as e:
                self._error(400, str(e), "BadRequestError")
                return
            reason = "length" if explicit else "stop"
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens,
                     "total_tokens": prompt_tokens + max_tokens}
            ident = ("chatcmpl-" if chat else "cmpl-") + rid
            created = int(time.time())
            words = app.token_words(seq)
            if body.get("stream"):
                opts = body.get("stream_options") or {}
                include_usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
                self._stream(chat, rid, q, words, ident, created, model, reason, usage, include_usage)
                return
            content = whole_answer(q, words)
            app.engine.finished(reason)
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": content, "tool_calls": []},
                          "logprobs": None, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": reason}
            self._json(200, {"id": ident, "object": "chat.completion" if chat else "text_completion",
                             "created": created, "model": model, "system_fingerprint": app.fingerprint,
                             "choices": [choice], "usage": usage})

        def _parse(self, chat: bool, body: dict) -> tuple[str, int, int, bool]:
            model = body.get("model") or app.opts.names[0]
            if model not in app.opts.names:
                raise BadRequest(404, f"The model `{model}` does not exist.", "NotFoundError")
            mt = body.get("max_completion_tokens", body.get("max_tokens"))
            explicit = mt is not None
            if mt is None:
                mt = app.opts.max_tokens_default
            if isinstance(mt, bool) or not isinstance(mt, int) or mt < 1:
                raise BadRequest(400, "max_tokens must be a positive integer", "BadRequestError")
            if chat:
                messages = body.get("messages")
                if not isinstance(messages, list) or not messages:
                    raise BadRequest(400, "messages must be a non-empty list", "BadRequestError")
                prompt = chat_prompt_tokens(messages)
            else:
                p = body.get("prompt")
                if isinstance(p, str):
                    prompt = estimate_tokens(p)
                elif isinstance(p, list) and p and all(isinstance(x, int) for x in p):
                    prompt = len(p)  # already tokenized
                elif isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
                    prompt = estimate_tokens(p[0])
                else:
                    raise BadRequest(400, "prompt must be a string (one prompt per request)", "BadRequestError")
            return model, prompt, mt, explicit

        def _write_chunk(self, data: bytes) -> None:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

        def _stream(self, chat, rid, q, words, ident, created, model, reason, usage, include_usage) -> None:
            obj = "chat.completion.chunk" if chat else "text_completion"

            def chunk(choices: list, with_usage: Any = None) -> bytes:
                d: dict[str, Any] = {"id": ident, "object": obj, "created": created, "model": model,
                                     "system_fingerprint": app.fingerprint, "choices": choices}
                if include_usage:
                    d["usage"] = with_usage
                return b"data: " + json.dumps(d).encode() + b"\n\n"

            try:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream; charset=utf-8")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                if chat:
                    self._write_chunk(chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                                              "logprobs": None, "finish_reason": None}]))
                while True:
                    e = q.get()
                    w = next(words)
                    fr = reason if e.done else None
                    if chat:
                        c = {"index": 0, "delta": {"content": w}, "logprobs": None, "finish_reason": fr}
                    else:
                        c = {"index": 0, "text": w, "logprobs": None, "finish_reason": fr}
                    self._write_chunk(chunk([c]))
                    if e.done:
                        break
                app.engine.finished(reason)
                if include_usage:
                    self._write_chunk(chunk([], usage))
                self._write_chunk(b"data: [DONE]\n\n")
                self._write_chunk(b"")  # end of chunked body
            except (BrokenPipeError, ConnectionResetError, TimeoutError, OSError):
                # The client went away: free its slot at once, as a real engine aborts the request.
                app.engine.cancel(rid)
                self.close_connection = True

    return Handler


class SimHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # many clients connect at once in load tests


def build_server(opts: ServerOptions) -> tuple[SimHTTPServer, SimApp]:
    app = SimApp(opts)
    server = SimHTTPServer((opts.host, opts.port), make_handler(app))
    return server, app
