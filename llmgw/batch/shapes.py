"""The Batch API's JSON, shaped as OpenAI's: the file and batch objects the views answer, and the
lines of a batch's output and error files. Pure."""

from __future__ import annotations

import hashlib
import json
import secrets

from llmgw.state.batch_records import BatchRecord, FileRecord


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


def new_batch_id() -> str:
    return "batch_" + secrets.token_hex(12)


def _ts(v: float | None) -> int | None:
    return None if v is None else int(v)


def file_object(f: FileRecord) -> dict:
    return {"id": f.id, "object": "file", "bytes": f.bytes, "created_at": int(f.created_at), "filename": f.filename,
            "purpose": f.purpose, "status": "processed", "status_details": None, "expires_at": None}


def batch_object(b: BatchRecord) -> dict:
    return {
        "id": b.id, "object": "batch", "endpoint": b.endpoint, "model": b.model or None,
        "errors": {"object": "list", "data": b.errors} if b.errors else None,
        "input_file_id": b.input_file_id, "completion_window": b.completion_window, "status": b.status,
        "output_file_id": b.output_file_id, "error_file_id": b.error_file_id,
        "created_at": int(b.created_at), "in_progress_at": _ts(b.in_progress_at), "expires_at": _ts(b.expires_at),
        "finalizing_at": _ts(b.finalizing_at), "completed_at": _ts(b.completed_at), "failed_at": _ts(b.failed_at),
        "expired_at": _ts(b.expired_at), "cancelling_at": _ts(b.cancelling_at), "cancelled_at": _ts(b.cancelled_at),
        "request_counts": {"total": b.total, "completed": b.n_completed, "failed": b.n_failed},
        "metadata": b.metadata or None,
        "usage": {"input_tokens": b.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": b.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": b.prompt_tokens + b.completion_tokens},
    }


def line_id(batch_id: str, index: int) -> str:
    """The id of a line's result: the same whoever writes it (a line is written once anyway)."""
    return "batch_req_" + hashlib.sha256(f"{batch_id}:{index}".encode()).hexdigest()[:24]


def answer_line(batch_id: str, index: int, custom_id: str, status: int, request_id: str, body) -> str:
    """A line of the output file (a 2xx answer) or of the error file (any other answer): OpenAI puts the
    engine's status and body under `response`; an error answer's message also under `error`."""
    error = None
    if not 200 <= status < 300:
        err = body.get("error") if isinstance(body, dict) else None
        err = err if isinstance(err, dict) else {}
        error = {"code": err.get("code") or f"http_{status}", "message": err.get("message") or f"HTTP {status}"}
    return json.dumps({"id": line_id(batch_id, index), "custom_id": custom_id,
                       "response": {"status_code": status, "request_id": request_id, "body": body},
                       "error": error}, separators=(",", ":"))


def error_line(batch_id: str, index: int, custom_id: str, code: str, message: str) -> str:
    """A line of the error file for a request that got no answer (expired, never sent, unreachable)."""
    return json.dumps({"id": line_id(batch_id, index), "custom_id": custom_id, "response": None,
                       "error": {"code": code, "message": message}}, separators=(",", ":"))


def usage_of(body) -> tuple[int, int]:
    """(prompt, completion) tokens an answer reports: chat and completions' `usage.prompt_tokens` /
    `completion_tokens`, the Responses API's `input_tokens` / `output_tokens`, embeddings' prompt only."""
    u = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(u, dict):
        return 0, 0

    def num(*names: str) -> int:
        for n in names:
            v = u.get(n)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                return max(0, int(v))
        return 0

    return num("prompt_tokens", "input_tokens"), num("completion_tokens", "output_tokens")
