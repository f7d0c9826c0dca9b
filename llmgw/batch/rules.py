"""What a new batch must be, and whether its key still lets its lines run. Pure.

`plan_batch` turns `POST /v1/batches`'s body and the input file's record into the batch to store, or
the refusal that names the field and the reason. `owner_refusal` is asked before each line is sent:
the key that created the batch may have been revoked, have expired, lost the model or the right to
run batches, or spent its token budget since; the same rules the gateway applies to a request
(`gateway.keys.policy.decide`), over the key record the feeder read.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from llmgw.state.batch_records import ANONYMOUS_OWNER, ENDPOINTS, BatchRecord, FileRecord
from llmgw.state.budget import iso
from llmgw.state.keypolicy import ApiKeyRecord

DEFAULT_WINDOW = "24h"
_WINDOW = re.compile(r"^\s*(\d+)\s*([mhd])\s*$")
_UNIT = {"m": 60, "h": 3600, "d": 86400}
MIN_WINDOW, MAX_WINDOW = 60, 7 * 86400
MAX_METADATA, MAX_META_KEY, MAX_META_VALUE = 16, 64, 512


@dataclass(frozen=True)
class Refusal:
    """Why a request about a batch is refused: a gateway.errors kind, the message, the field."""

    kind: str
    message: str
    param: str | None = None


def parse_window(text: object) -> float | Refusal:
    """`completion_window`: OpenAI's "24h", or another whole number of minutes, hours or days ("30m",
    "2d": llmgw's extension) from one minute to a week. Seconds."""
    m = _WINDOW.match(text) if isinstance(text, str) else None
    if not m:
        return Refusal("bad_request", f"completion_window: expected a duration such as 24h, got {text!r}",
                       "completion_window")
    seconds = int(m.group(1)) * _UNIT[m.group(2)]
    if not MIN_WINDOW <= seconds <= MAX_WINDOW:
        return Refusal("bad_request", f"completion_window: must be from 1m to 7d, got {text!r}", "completion_window")
    return float(seconds)


def check_metadata(md: object) -> dict[str, str] | Refusal:
    """OpenAI's metadata: at most 16 pairs of strings, keys up to 64 characters, values up to 512."""
    if md is None:
        return {}
    if not isinstance(md, dict):
        return Refusal("bad_request", "metadata: expected an object of strings", "metadata")
    if len(md) > MAX_METADATA:
        return Refusal("bad_request", f"metadata: at most {MAX_METADATA} pairs, got {len(md)}", "metadata")
    for k, v in md.items():
        if not isinstance(v, str) or len(k) > MAX_META_KEY or len(v) > MAX_META_VALUE:
            return Refusal("bad_request", f"metadata.{k}: keys are strings of at most {MAX_META_KEY} characters, "
                                          f"values strings of at most {MAX_META_VALUE}", f"metadata.{k}")
    return dict(md)


def plan_batch(body: object, file: FileRecord | None, owner: str, now: float, batch_id: str) -> BatchRecord | Refusal:
    """The batch `POST /v1/batches` asks for, or why not. `file`: the record of its input_file_id as
    the caller may see it (None: no such file of theirs)."""
    if not isinstance(body, dict):
        return Refusal("bad_request", "expected a JSON object")
    fid = body.get("input_file_id")
    if not isinstance(fid, str) or not fid:
        return Refusal("bad_request", "input_file_id: expected the id of an uploaded file", "input_file_id")
    endpoint = body.get("endpoint")
    if endpoint not in ENDPOINTS:
        return Refusal("bad_request", f"endpoint: expected one of {', '.join(ENDPOINTS)}, got {endpoint!r}", "endpoint")
    window = parse_window(body.get("completion_window", DEFAULT_WINDOW))
    if isinstance(window, Refusal):
        return window
    metadata = check_metadata(body.get("metadata"))
    if isinstance(metadata, Refusal):
        return metadata
    if file is None:
        return Refusal("not_found", f"no file {fid!r}", "input_file_id")
    if file.purpose != "batch" or file.kind != "input":
        return Refusal("bad_request", f"input_file_id: file {fid!r} has purpose {file.purpose!r}; a batch reads a file "
                                      "uploaded with purpose 'batch'", "input_file_id")
    if file.endpoint != endpoint:
        return Refusal("bad_request", f"input_file_id: line 1 of {fid!r} has url {file.endpoint!r} but the batch's "
                                      f"endpoint is {endpoint!r}", "endpoint")
    return BatchRecord(id=batch_id, owner=owner, endpoint=endpoint, input_file_id=fid,
                       completion_window=str(body.get("completion_window", DEFAULT_WINDOW)).strip(),
                       created_at=now, expires_at=now + window, total=file.requests, model=file.model,
                       metadata=metadata)


def owner_refusal(b: BatchRecord, key: ApiKeyRecord | None, names: frozenset[str], used: int,
                  now: float) -> tuple[str, str] | None:
    """Why the batch's lines may not run now, as an error line's (code, message); None: they may.
    `key`: the record of the batch's owner (None: revoked); `names`: every name of the batch's model;
    `used`: the tokens the key spent in its budget period so far."""
    if b.owner == ANONYMOUS_OWNER:
        return None
    if key is None:
        return "invalid_api_key", "the API key that created this batch was revoked"
    if key.expires_at is not None and now >= key.expires_at:
        return "expired_api_key", f"API key {key.name} expired at {iso(key.expires_at)}"
    if not key.batches:
        return "batches_not_allowed", f"API key {key.name} may no longer run batches"
    if key.models and not any(m in names for m in key.models):
        return "model_not_found", f"model {b.model!r} does not exist"
    if key.budget is not None and used >= key.budget:
        period = key.period(now)
        resets = f"; the budget resets at {iso(period.end)}" if period is not None else ""
        return "budget_exceeded", (f"API key {key.name} has spent {used} of its {key.budget} tokens this "
                                   f"{key.budget_period} (UTC){resets}")
    return None


def seconds_left(b: BatchRecord, now: float) -> int:
    return max(0, math.ceil(b.expires_at - now))
