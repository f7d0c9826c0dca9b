"""How the gateway served one request, for `llmgw explain REQUEST_ID` and the console's playground. Pure.

A request that asks for it (`X-LLMGW-Explain: 1`; the playground always does) is written down as its
gateway serves it (gateway.observe.explain.Recorder, fed by the same hooks as its trace): each routing
choice and the rule that made it, the wait in the model's queue, each attempt and the replica it went
to, an attempt that failed before the first byte, an engine that broke off after it and where the
answer went on, the status, the tokens and the times; and the answer's own routing header
(`X-LLMGW-Prefix`: the expected prefix-cache hit, the requests and prefill ahead there). The gateways
flush these records to Redis with their usage (`llmgw:served:<request id>`, kept SERVED_KEEP seconds).

`sentences(record)` says it in words; the console and `llmgw explain` show the same sentences.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from llmgw.state.budget import iso

SERVED_KEEP = 3600  # seconds a request's record stays readable after its answer ended
# The request ids a record is kept under (the gateway's own are 32 hex digits; a client's X-Request-Id
# may be anything, and only an id of this shape is recorded).
REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
HEADER = "X-LLMGW-Explain"  # the request header that asks for the record


def recordable(rid: str) -> bool:
    return REQUEST_ID.fullmatch(rid) is not None


@dataclass(frozen=True)
class Served:
    """One request's record. `steps` in order, each a dict with a `kind`:
    queued {position}; dequeued {outcome, waited}; choice {endpoint, reason, saturated};
    attempt {n, endpoint, replica, node, engine, at}; failed {outcome, status, retried} (outcome
    `broken:<cause>` after the first byte); the answer's end is the record's own fields."""

    id: str
    ts: float  # when the gateway read it (epoch seconds)
    route: str  # "/v1/chat/completions"
    model: str = ""  # as the client named it
    key: str = ""  # the name of the API key the client sent, if the gateway knew it ("" without one)
    key_id: str = ""  # its id: who may read the record (gateway.http.served)
    status: int | None = None  # the status the client got
    completed: bool = False  # the answer was passed on whole
    error: str = ""  # the gateway's own refusal: "<kind>: <message>"
    usage: tuple[int, int] | None = None  # (prompt, completion) tokens the engine reported
    first_byte: float | None = None  # seconds from arrival to the answer's first byte
    seconds: float | None = None  # from arrival to the end
    steps: tuple[dict[str, Any], ...] = ()
    routing: str = ""  # the answer's X-LLMGW-Prefix header (the first endpoint's prefix-cache routing)
    header_endpoint: str = ""  # the answer's X-LLMGW-Endpoint header
    served_by: dict[str, str] = field(default_factory=dict)  # the endpoint that answered last

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, blob: str) -> "Served":
        """Raises ValueError on a malformed record."""
        try:
            d = json.loads(blob)
            usage = d.get("usage")
            return cls(id=str(d["id"]), ts=float(d["ts"]), route=str(d.get("route", "")), model=str(d.get("model", "")),
                       key=str(d.get("key", "")), key_id=str(d.get("key_id", "")), status=d.get("status"),
                       completed=d.get("completed") is True, error=str(d.get("error", "")),
                       usage=(int(usage[0]), int(usage[1])) if usage else None,
                       first_byte=d.get("first_byte"), seconds=d.get("seconds"),
                       steps=tuple(s for s in d.get("steps") or () if isinstance(s, dict)),
                       routing=str(d.get("routing", "")), header_endpoint=str(d.get("header_endpoint", "")),
                       served_by=dict(d.get("served_by") or {}))
        except (AttributeError, KeyError, TypeError, ValueError, IndexError) as e:
            raise ValueError(f"request record: {e}") from None

    def view(self) -> dict:
        """What the gateway's `GET /v1/llmgw/requests/{id}` answers: the record, its routing header
        read into fields, and the sentences."""
        return {**asdict(self), "routing_fields": routing_fields(self.routing), "explanation": sentences(self)}


def routing_fields(note: str) -> dict[str, str]:
    """An `X-LLMGW-Prefix` header (gateway.http.answer.prefix_note) read into its fields:
    matched, endpoint_hit, saved_ms, via, expected_ms, ahead, backlog_ms, held_ms, rule, and where
    another endpoint came next, runner_up, runner_up_ms, runner_up_matched."""
    out = {}
    for part in note.split("; "):
        name, eq, value = part.partition("=")
        if eq:
            out[name.strip()] = value.strip().strip('"')
    return out


def _secs(v: float) -> str:
    return f"{v * 1000:.0f} ms" if v < 1 else f"{v:.2f} s"


def _where(step: dict) -> str:
    rep = step.get("replica") or step.get("endpoint") or "?"
    node = f" on node {step['node']}" if step.get("node") else ""
    engine = f" ({step['engine']})" if step.get("engine") else ""
    return f"replica {rep}{node}{engine}"


def _routing_sentence(note: str) -> str | None:
    f = routing_fields(note)
    if not f:
        return None
    parts = []
    matched = f.get("matched", "")
    if matched:
        got, _, total = matched.replace(" tokens", "").partition("/")
        hit = f.get("endpoint_hit")
        share = f"{float(hit):.0%}" if hit else "?"
        via = " (from the engine's own KV events)" if f.get("via") == "kv_events" else ""
        parts.append(f"expected prefix-cache hit {share}: {got} of {total} prompt tokens{via}")
        if f.get("saved_ms") and float(f["saved_ms"]) > 0:
            parts.append(f"saving about {float(f['saved_ms']):.0f} ms of prefill")
    if f.get("ahead"):
        parts.append(f"{f['ahead']} request(s) already there, {f.get('backlog_ms', '0')} ms of prefill queued")
    if f.get("expected_ms"):
        parts.append(f"expected cost {f['expected_ms']} ms")
    if f.get("held_ms") and f["held_ms"] != "0":
        parts.append(f"held {f['held_ms']} ms in the gateway's queue first")
    rule = f" by the rule \"{f['rule']}\"" if f.get("rule") else ""
    line = f"Routed{rule}: " + "; ".join(parts) + "." if parts else f"Routed{rule}."
    if f.get("runner_up"):
        line += (f" Next came {f['runner_up']}, expected cost {f.get('runner_up_ms', '?')} ms, expected to hold "
                 f"{f.get('runner_up_matched', '0')} prompt tokens.")
    return line


def sentences(rec: Served) -> list[str]:
    """The record in plain sentences, in the order things happened."""
    who = f", key {rec.key!r}" if rec.key else ""
    out = [f"Request {rec.id}: {rec.route} for model {rec.model or '?'}{who}, at {iso(rec.ts)}."]
    attempts = 0
    for s in rec.steps:
        kind = s.get("kind")
        if kind == "queued":
            out.append(f"It waited in the model's queue (position {s.get('position')}).")
        elif kind == "dequeued":
            waited = s.get("waited")
            out.append(f"The wait ended after {_secs(waited) if waited is not None else '?'}: {s.get('outcome')}.")
        elif kind == "choice":
            sat = " past saturation (critical traffic)" if s.get("saturated") else ""
            out.append(f"The router picked {s.get('endpoint')}{sat} ({s.get('reason') or 'no reason given'}).")
        elif kind == "attempt":
            attempts += 1
            at = s.get("at")
            when = f" at {_secs(at)}" if at is not None else ""
            out.append(f"Attempt {s.get('n', attempts - 1) + 1} went to {_where(s)}{when}.")
        elif kind == "targets":
            pred = s.get("predicted")
            said = f"; the router predicted its first token {_secs(pred)} after it was sent" if pred is not None else ""
            verdict = f"it missed them: {s['missed']}" if s.get("missed") else "it met them"
            out.append(f"Its latency targets were {s.get('targets')}{said}; {verdict}.")
        elif kind == "failed":
            outcome = str(s.get("outcome", ""))
            status = f" (HTTP {s['status']})" if s.get("status") else ""
            if outcome.startswith("broken:"):
                then = ("the answer went on from another replica" if s.get("retried")
                        else "the answer could not go on elsewhere and was cut")
                out.append(f"Its engine broke off after the first byte ({outcome[7:]}): {then}.")
            else:
                then = "tried again elsewhere" if s.get("retried") else "no other try"
                out.append(f"That attempt failed before the first byte: {outcome}{status}; {then}.")
    if rec.routing:
        line = _routing_sentence(rec.routing)
        if line:
            where = f" to {rec.header_endpoint}" if rec.header_endpoint else ""
            out.append(line.replace("Routed", f"Routed{where}", 1))
    if rec.error:
        out.append(f"The gateway answered HTTP {rec.status} itself: {rec.error}.")
    elif rec.served_by:
        tokens = f", {rec.usage[0]} prompt and {rec.usage[1]} completion tokens" if rec.usage else ""
        first = f", first byte after {_secs(rec.first_byte)}" if rec.first_byte is not None else ""
        total = f", {_secs(rec.seconds)} in all" if rec.seconds is not None else ""
        how = "" if rec.completed else " The answer was cut short (the client left, the engine broke off, or the " \
                                         "total timeout)."
        out.append(f"Served by {_where(rec.served_by)}: HTTP {rec.status}{tokens}{first}{total}.{how}")
    elif rec.status is None:
        out.append("It has not ended yet.")
    return out
