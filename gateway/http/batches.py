"""The Batch API as the `openai` SDK calls it: `/v1/files` (purpose `batch`) and `/v1/batches`.

Thin shells: who asks (the key, which owns what it makes and sees only that), read the request, the
pure rules (`llmgw.batch.lines` checks an upload line by line as it arrives, `llmgw.batch.rules`
plans a batch), one write through the store, and a run task sent to the batch workers
(`workers/batch/`), which feed the lines to the gateways at the lowest priority. docs/batch.md.

An upload is read from the request a line at a time (werkzeug spools the file part to a temporary
file past 500 KB) and written to Redis in chunks of whole lines as it goes; a refused upload leaves
nothing. Checking is CPU work on the event loop: the view yields to the other greenlets every few
hundred lines.
"""

from __future__ import annotations

import functools
import logging
import time

from flask import Flask, Response, request

from gateway.errors import ApiError
from gateway.observe.health import REDIS_ERRORS
from llmgw.batch import kick
from llmgw.batch.config import BatchSettings
from llmgw.batch.lines import Chunker, FileChecker, Limits, summary
from llmgw.batch.rules import Refusal, plan_batch
from llmgw.batch.shapes import batch_object, file_object, new_batch_id, new_file_id
from llmgw.state.batch_records import ANONYMOUS_OWNER, FileRecord
from llmgw.state.kicks import broker_app

log = logging.getLogger("llmgw.gateway")

YIELD_EVERY = 256  # lines checked between yields to the other greenlets
LIST_MAX = 100


class BatchApi:
    """The views of one gateway process (`gw`: its gateway.app.Gateway)."""

    def __init__(self, gw, settings: BatchSettings):
        self.gw, self.settings = gw, settings
        self.limits = Limits(settings.max_file_bytes, settings.max_requests, settings.max_line_bytes)
        self._send: kick.Sender | None = None

    # --- who asks --------------------------------------------------------------------------------
    def owner(self) -> str:
        """The caller's key id (its files and batches), or ANONYMOUS_OWNER while no key is required; 401,
        and 403 for a key that may not run batches (`llmgw keys update NAME --no-batches`)."""
        gate = self.gw.gate
        key = gate.authenticate(request.environ)
        if key is None:
            return ANONYMOUS_OWNER
        gate.enforce(key, None)
        if not key.batches:
            raise ApiError("batches_forbidden", f"API key {key.name!r} may not use the Batch API "
                                                f"(llmgw keys update {key.name} --batches allows it)")
        return key.id

    def send_run(self, batch_id: str) -> None:
        if self._send is None:
            self._send = kick.celery_run_sender(broker_app(self.gw.cfg.redis_url))
        kick.send_run(self.gw.store, self._send, batch_id, kick.queued_ttl(self.settings.slice_seconds))

    def _file(self, owner: str, file_id: str) -> FileRecord:
        f = self.gw.store.file(file_id)
        if f is None or f.owner != owner:
            raise ApiError("not_found", f"no file {file_id!r}")
        return f

    # --- files -----------------------------------------------------------------------------------
    def upload(self):
        owner = self.owner()
        # The gateway's body limit is for requests to engines; an upload has its own.
        request.max_content_length = self.settings.max_file_bytes + 1024 * 1024
        purpose = request.form.get("purpose")
        if purpose != "batch":
            raise ApiError("bad_request", f"purpose: llmgw stores files for the Batch API only ('batch'), got {purpose!r}")
        part = request.files.get("file")
        if part is None:
            raise ApiError("bad_request", "file: expected a multipart part named 'file' (the JSONL requests)")
        fid = new_file_id()
        store = self.gw.store
        checker, chunker = FileChecker(self.limits), Chunker()
        stored = True
        try:
            while True:
                raw = part.stream.readline(self.limits.max_line_bytes + 2)
                if not raw:
                    break
                text = checker.line(raw)
                if checker.too_large:
                    break
                if text is None or checker.problems:
                    stored = False  # refused: check on, but keep nothing
                elif stored and (chunk := chunker.add(text, len(raw))) is not None:
                    store.append_file_chunk(fid, chunk)
                if checker.lineno % YIELD_EVERY == 0:
                    time.sleep(0)  # gevent: let the other greenlets run
            problems = checker.finish()
            if problems:
                store.drop_file_data(fid)
                if checker.too_large:
                    raise ApiError("too_large", problems[0].message)
                raise ApiError("bad_request", f"{part.filename or 'the file'} cannot run as a batch: {summary(problems)}")
            last = chunker.flush()
            if last is not None:
                store.append_file_chunk(fid, last)
            rec = FileRecord(id=fid, owner=owner, filename=part.filename or "batch.jsonl", purpose="batch",
                             bytes=checker.bytes, created_at=self.gw.clock.time(), requests=checker.requests,
                             chunks=chunker.chunks, endpoint=checker.endpoint, model=checker.model,
                             first_line=checker.first_line)
            store.commit_file(rec)
        except BaseException:
            try:
                store.drop_file_data(fid)
            except REDIS_ERRORS:
                pass  # the chunks expire by themselves
            raise
        return file_object(rec)

    def list_files(self):
        owner = self.owner()
        args = request.args
        limit = _limit(args.get("limit"), 10_000, 10_000)
        order = args.get("order", "desc")
        if order not in ("asc", "desc"):
            raise ApiError("bad_request", f"order: expected asc or desc, got {order!r}")
        purpose = args.get("purpose")
        files = self.gw.store.list_files(owner, args.get("after") or None, limit + 1, newest_first=order == "desc")
        if purpose:
            files = [f for f in files if f.purpose == purpose]
        return {"object": "list", "data": [file_object(f) for f in files[:limit]], "has_more": len(files) > limit,
                "first_id": files[0].id if files else None, "last_id": files[:limit][-1].id if files else None}

    def get_file(self, file_id: str):
        return file_object(self._file(self.owner(), file_id))

    def content(self, file_id: str):
        f = self._file(self.owner(), file_id)
        store = self.gw.store
        if f.kind == "input":
            chunks = store.file_chunks(f.id)
        else:
            b = store.batch(f.batch_id)
            total = b.total if b is not None else 0
            chunks = ("".join(line + "\n" for line in page) for page in store.result_lines(f.batch_id, f.kind, total))
        resp = Response(_encoded(chunks), mimetype="application/jsonl")
        resp.headers["Content-Length"] = str(f.bytes)
        return resp

    def delete_file(self, file_id: str):
        owner = self.owner()
        f = self._file(owner, file_id)
        store = self.gw.store
        if f.kind == "input":
            for b in store.batches(store.active_batch_ids()):
                if b.input_file_id == f.id and not b.ended:
                    raise ApiError("bad_request", f"file {file_id!r} is the input of batch {b.id}, which is {b.status}; "
                                                  "cancel it first")
        store.delete_file(f)
        return {"id": f.id, "object": "file", "deleted": True}

    # --- batches ---------------------------------------------------------------------------------
    def create(self):
        owner = self.owner()
        body = request.get_json(silent=True)
        store = self.gw.store
        fid = body.get("input_file_id") if isinstance(body, dict) else None
        f = store.file(fid) if isinstance(fid, str) and fid else None
        plan = plan_batch(body, f if f is not None and f.owner == owner else None, owner, self.gw.clock.time(),
                          new_batch_id())
        if isinstance(plan, Refusal):
            raise ApiError(plan.kind, plan.message)
        self._check_model(plan.model, f)
        store.create_batch(plan)
        self.send_run(plan.id)
        return batch_object(plan)

    def _check_model(self, model: str, f: FileRecord | None) -> None:
        """The model the lines name must exist, and the caller's key may call it (and have budget)."""
        where = f"line {f.first_line} of {f.id}" if f is not None and f.first_line else "the input file"
        tables = self.gw.router.tables
        if model not in tables.known_models:
            raise ApiError("model_not_found", f"{where}: model {model!r} does not exist")
        key = self.gw.gate.authenticate(request.environ)
        if key is not None:
            try:
                self.gw.gate.enforce(key, model)
            except ApiError as e:
                raise ApiError(e.kind, f"{where}: {e.message}", e.retry_after) from None

    def get_batch(self, batch_id: str):
        return batch_object(self._batch(self.owner(), batch_id))

    def _batch(self, owner: str, batch_id: str):
        b = self.gw.store.batch(batch_id)
        if b is None or b.owner != owner:
            raise ApiError("not_found", f"no batch {batch_id!r}")
        return b

    def list_batches(self):
        owner = self.owner()
        limit = _limit(request.args.get("limit"), 20, LIST_MAX)
        found = self.gw.store.list_batches(owner, request.args.get("after") or None, limit + 1)
        page = found[:limit]
        return {"object": "list", "data": [batch_object(b) for b in page], "has_more": len(found) > limit,
                "first_id": page[0].id if page else None, "last_id": page[-1].id if page else None}

    def cancel(self, batch_id: str):
        owner = self.owner()
        store = self.gw.store
        b = self._batch(owner, batch_id)
        if b.ended:
            raise ApiError("bad_request", f"batch {batch_id} is {b.status}; only a batch still running can be cancelled")
        if b.cancelling_at is None:
            store.update_batch(batch_id, cancelling_at=self.gw.clock.time())
        self.send_run(batch_id)  # a batch nobody feeds now is sealed at once
        return batch_object(store.batch(batch_id) or b)


def _encoded(chunks):
    for c in chunks:
        yield c.encode()


def _limit(text: str | None, default: int, most: int) -> int:
    if text is None:
        return default
    try:
        n = int(text)
    except ValueError:
        raise ApiError("bad_request", f"limit: expected an integer, got {text!r}") from None
    if not 1 <= n <= most:
        raise ApiError("bad_request", f"limit: expected 1 to {most}, got {n}")
    return n


def register(app: Flask, gw, settings: BatchSettings | None = None) -> BatchApi:
    """Add the Batch API's routes to the gateway's Flask app."""
    api = BatchApi(gw, settings or BatchSettings.from_env())

    def view(fn):
        @functools.wraps(fn)
        def run(*args, **kw):
            try:
                return fn(*args, **kw)
            except REDIS_ERRORS as e:
                raise ApiError("unavailable", f"the Batch API cannot reach Redis: {type(e).__name__}: {e}") from None
        return run

    app.add_url_rule("/v1/files", "files_upload", view(api.upload), methods=["POST"])
    app.add_url_rule("/v1/files", "files_list", view(api.list_files), methods=["GET"])
    app.add_url_rule("/v1/files/<file_id>", "files_get", view(api.get_file), methods=["GET"])
    app.add_url_rule("/v1/files/<file_id>", "files_delete", view(api.delete_file), methods=["DELETE"])
    app.add_url_rule("/v1/files/<file_id>/content", "files_content", view(api.content), methods=["GET"])
    app.add_url_rule("/v1/batches", "batches_create", view(api.create), methods=["POST"])
    app.add_url_rule("/v1/batches", "batches_list", view(api.list_batches), methods=["GET"])
    app.add_url_rule("/v1/batches/<batch_id>", "batches_get", view(api.get_batch), methods=["GET"])
    app.add_url_rule("/v1/batches/<batch_id>/cancel", "batches_cancel", view(api.cancel), methods=["POST"])
    app.extensions["llmgw.batches"] = api
    return api

