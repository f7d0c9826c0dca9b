"""The simulated engine's HTTP side: the routing of paths over the engine (simengine.engine), with
OpenAI payloads from simengine.openai and streams written by simengine.sse.

Each request is a thread (stdlib `ThreadingHTTPServer`, daemon threads: hundreds of concurrent
streams); a generating request submits its sequence to the batching core and writes its tokens as
they arrive.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
import uuid
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from simengine import openai as oa
from simengine import pooling
from simengine import responses as rapi
from simengine import sse
from simengine import tokens as tok
from simengine.core import RequestTooLarge
from simengine.engine import ServerOptions, SimApp, log
from simengine.lora import LOAD_PATH, UNLOAD_PATH
from simengine.openai import BadRequest

__all__ = ["ServerOptions", "SimApp", "build_server", "log"]

# vLLM's AuthenticationMiddleware guards these path prefixes; /health and /metrics stay open.
GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")


def token_digest(token: str) -> str:
    """How --log-headers shows a bearer token: enough to tell which one it was, useless to replay."""
    return "sha256:" + hashlib.sha256(token.encode()).hexdigest()[:16]


RESPONSES_PATH = "/v1/responses/"
TRANSCRIPTIONS_PATH = "/v1/audio/transcriptions"
# POST path -> the handler method (vLLM's paths, with and without /v1 where vLLM has both).
POST_ROUTES = {
    "/v1/chat/completions": "_chat", "/v1/completions": "_completion", "/v1/responses": "_responses",
    "/v1/rerank": "_rerank", "/rerank": "_rerank", "/v1/score": "_score", "/score": "_score",
    "/tokenize": "_tokenize", "/detokenize": "_detokenize", TRANSCRIPTIONS_PATH: "_transcribe",
    "/v1/chat/completions/render": "_render_chat", "/v1/completions/render": "_render_completion",
}
GENERATING = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})  # count for --crash-after


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 600  # drop idle keep-alive connections of clients that vanished
    server_version = "llmgw-simengine/0.1"
    app: SimApp  # set on the subclass make_handler builds

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        if self.app.opts.log_requests:
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
        if self.app.opts.log_headers:
            shown = []
            for name, value in self.headers.items():
                if name.lower() == "authorization":
                    scheme, space, token = value.partition(" ")
                    value = f"{scheme} {token_digest(token)}" if space else token_digest(value)
                shown.append(f"{name}: {value}")
            log(f"headers of {self.command} {path}: " + " | ".join(shown))
        key = self.app.opts.api_key
        if not key or not path.startswith(GUARDED_PREFIXES):
            return True
        scheme, _, token = (self.headers.get("Authorization") or "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), key.encode()):
            return True
        self.close_connection = True  # a POST's body was not read
        self._json(401, {"error": {"message": "Unauthorized", "type": "authentication_error", "code": 401}})
        return False

    def _loading(self) -> bool:
        reason = self.app.loading_reason()
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
            self._send(200, self.app.metrics_text().encode(), "text/plain; version=0.0.4; charset=utf-8")
        elif path.startswith(RESPONSES_PATH):
            found = self.app.responses.get(path[len(RESPONSES_PATH):])
            if found is None:
                self._error(404, f"Response with id '{path[len(RESPONSES_PATH):]}' not found.", "NotFoundError")
            else:
                self._json(200, found)
        elif path == "/v1/models":
            if not self._loading():
                created = int(time.time())
                adapters = self.app.adapters.cards(self.app.opts.names[0], created) if self.app.adapters else []
                self._json(200, {"object": "list", "data": [
                    {"id": n, "object": "model", "created": created, "owned_by": "llmgw-sim",
                     "root": self.app.opts.names[0], "parent": None,
                     "max_model_len": self.app.opts.core.kv_tokens} for n in self.app.opts.names] + adapters})
        else:
            self._error(404, f"no route {path}", "NotFoundError")

    def do_DELETE(self) -> None:  # noqa: N802 - stdlib name
        path = self.path.split("?", 1)[0]
        if not path.startswith(RESPONSES_PATH):
            self._error(404, f"no route {path}", "NotFoundError")
        elif self.app.responses.delete(path[len(RESPONSES_PATH):]):
            self._json(200, {"id": path[len(RESPONSES_PATH):], "object": "response", "deleted": True})
        else:
            self._error(404, f"Response with id '{path[len(RESPONSES_PATH):]}' not found.", "NotFoundError")

    def do_POST(self) -> None:  # noqa: N802 - stdlib name
        path = self.path.split("?", 1)[0]
        if not self._authorized(path):
            return
        handler = POST_ROUTES.get(path)
        lora = self.app.opts.lora
        if path in (LOAD_PATH, UNLOAD_PATH) and lora is not None and lora.runtime:
            handler = "_lora"
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
                self.app.answered()

    def _lora(self, body: dict) -> None:
        assert self.app.adapters is not None
        path = self.path.split("?", 1)[0]
        reply = self.app.adapters.load(body) if path == LOAD_PATH else self.app.adapters.unload(body)
        self._send(reply.status, reply.body, reply.ctype)

    def _chat(self, body: dict) -> None:
        self._complete(True, body)

    def _completion(self, body: dict) -> None:
        self._complete(False, body)

    def _model(self, body: dict) -> str:
        return oa.model_of(body, self.app.served())

    def _job(self, chat: bool, body: dict) -> oa.Job:
        return oa.parse(chat, body, self.app.served(), self.app.opts.max_tokens_default, self.app.opts.metrics_style)

    def _render_chat(self, body: dict) -> None:
        self._json(200, oa.render(self._job(True, body), f"chatcmpl-{uuid.uuid4().hex}"))

    def _render_completion(self, body: dict) -> None:
        self._json(200, [oa.render(self._job(False, body), f"cmpl-{uuid.uuid4().hex}")])

    def _complete(self, chat: bool, body: dict) -> None:
        app = self.app
        job = self._job(chat, body)
        _, fail = app.next_request()
        if fail:
            raise BadRequest(500, "simulated engine error (--error-rate)", "InternalServerError")
        adapter = app.adapter_of(job.model)
        if app.opts.answer_model:
            job = replace(job, model=app.opts.answer_model)
        words = app.answer(job.context, job.max_tokens, adapter, job.continued)
        try:
            rid, q = app.engine.submit(len(job.tokens), job.max_tokens, job.tokens,
                                       [tok.word_token(w) for w in words], job.salt, adapter, job.priority)
        except RequestTooLarge as e:
            raise BadRequest(400, str(e), "BadRequestError") from None
        ident = ("chatcmpl-" if chat else "cmpl-") + rid
        created = int(time.time())
        llamacpp = app.opts.metrics_style == "llamacpp"
        if job.stream:
            w = sse.Writer(self.wfile, self._sse_head)
            try:
                sse.stream_completion(w, app.opts.start, job, oa.Chunks(job, ident, created, app.fingerprint), q,
                                      words, llamacpp, app.opts.close_early)
                app.engine.finished(job.reason)
            except sse.ClosedEarly:
                app.engine.cancel(rid)
            except sse.DISCONNECTED:
                # The client went away: free its slot at once, as a real engine aborts the request.
                app.engine.cancel(rid)
                self.close_connection = True
            return
        # vLLM aborts a non-streamed request whose client left, as it does a stream; llama-server
        # notices only between streamed tokens (llmgw's engine drivers say so: `aborts_unstreamed`).
        gone = None if llamacpp else (lambda: sse.peer_closed(self.connection))
        try:
            content, cached, first, last = sse.whole_answer(q, words, gone)
        except sse.ClientGone:
            app.engine.cancel(rid)
            self.close_connection = True
            return
        app.engine.finished(job.reason)
        timings = oa.timings(len(job.tokens) - (cached or 0), cached or 0, first, job.max_tokens, last - first) \
            if llamacpp else None
        self._json(200, oa.whole(job, ident, created, app.fingerprint, content, cached if llamacpp else None, timings))

    def _sse_head(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def _responses(self, body: dict) -> None:
        app = self.app
        model = self._model(body)
        text = rapi.input_text(body.get("input"))
        if text is None:
            raise BadRequest(400, "input must be a string or a list of messages", "BadRequestError")
        prompt = tok.estimate_tokens(text)
        if isinstance(body.get("instructions"), str):
            prompt += tok.estimate_tokens(body["instructions"])
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
        _, fail = app.next_request()
        if fail:
            raise BadRequest(500, "simulated engine error (--error-rate)", "InternalServerError")
        try:
            core_id, q = app.engine.submit(prompt, mt, adapter=app.adapter_of(model))
        except RequestTooLarge as e:
            raise BadRequest(400, str(e), "BadRequestError") from None
        rid, msg_id = rapi.new_ids()
        context = rapi.context(body.get("instructions"), text, previous)
        created, words = int(time.time()), app.answer(context, mt, app.adapter_of(model))
        model = app.opts.answer_model or model
        finish = "length" if explicit else "stop"
        keep = body.get("store", True) is not False

        def final(out: str) -> dict:
            app.engine.finished(finish)
            resp = rapi.response(rid, msg_id, model, created, "completed", out, previous, rapi.usage(prompt, mt),
                                 body.get("max_output_tokens"))
            if keep:
                app.responses.put(resp)
            return resp

        if not body.get("stream"):
            self._json(200, final(sse.whole_answer(q, words)[0]))
            return
        started = rapi.response(rid, msg_id, model, created, "in_progress", "", previous, None,
                                body.get("max_output_tokens"))
        try:
            sse.stream_responses(sse.Writer(self.wfile, self._sse_head), q, words, started, msg_id, final,
                                 app.opts.close_early)
        except sse.ClosedEarly:
            app.engine.cancel(core_id)
        except sse.DISCONNECTED:
            app.engine.cancel(core_id)
            self.close_connection = True

    def _rerank(self, body: dict) -> None:
        model = self._model(body)
        query, docs, top_n = body.get("query"), body.get("documents"), body.get("top_n")
        if not isinstance(query, str) or not isinstance(docs, list):
            raise BadRequest(400, "query must be a string and documents a list", "BadRequestError")
        if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 0):
            raise BadRequest(400, "top_n must be a non-negative integer", "BadRequestError")
        answer, tokens = pooling.rerank(model, query, docs, top_n)
        self.app.engine.pooled(tokens)
        self._json(200, answer)

    def _score(self, body: dict) -> None:
        model = self._model(body)
        a, b = body.get("text_1"), body.get("text_2")
        if a is None or b is None:
            raise BadRequest(400, "text_1 and text_2 are required", "BadRequestError")
        answer, tokens = pooling.score(model, a, b, int(time.time()))
        self.app.engine.pooled(tokens)
        self._json(200, answer)

    def _tokenize(self, body: dict) -> None:
        model = self._model(body)
        if isinstance(body.get("messages"), list):
            tokens = tok.chat_tokens(body["messages"])  # vLLM applies the chat template
        elif isinstance(body.get("prompt"), str):
            tokens = tok.tokenize(body["prompt"])
        else:
            raise BadRequest(400, "prompt (a string) or messages is required", "BadRequestError")
        self._json(200, {"count": len(tokens), "max_model_len": self.app.opts.core.kv_tokens, "tokens": tokens,
                         "model": model})

    def _detokenize(self, body: dict) -> None:
        self._model(body)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and t > 0 for t in tokens):
            raise BadRequest(400, "tokens must be a list of positive integers", "BadRequestError")
        self._json(200, {"prompt": tok.detokenize(tokens)})

    def _transcribe(self, raw: bytes) -> None:
        try:
            fields = pooling.form_fields(self.headers.get("Content-Type", ""), raw)
        except ValueError as e:
            raise BadRequest(400, str(e), "BadRequestError") from None
        self._model({"model": fields.get("model") if isinstance(fields.get("model"), str) else None})
        audio = fields.get("file")
        if not isinstance(audio, bytes):
            raise BadRequest(400, "the form needs a `file` with the audio", "BadRequestError")
        self.app.engine.pooled(max(1, len(audio) // 1000))
        self._json(200, {"text": pooling.TRANSCRIPT})


def make_handler(app: SimApp) -> type[BaseHTTPRequestHandler]:
    return type("SimHandler", (Handler,), {"app": app})


class SimHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # many clients connect at once in load tests


def build_server(opts: ServerOptions, publish=None) -> tuple[SimHTTPServer, SimApp]:
    app = SimApp(opts, publish)
    server = SimHTTPServer((opts.host, opts.port), make_handler(app))
    return server, app
