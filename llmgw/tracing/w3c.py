"""W3C Trace Context headers: `traceparent` parsed strictly, `tracestate` cleaned, both formatted.

Pure and dependency-free, so the gateway can forward a client's trace context even when this
process exports nothing (the forwarding mode of the spec) without importing OpenTelemetry.
"""

from __future__ import annotations

import re
from typing import NamedTuple

# version "-" trace-id "-" parent-id "-" trace-flags, lowercase hex only (HEXDIGLC).
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_ZERO_TRACE, _ZERO_SPAN = "0" * 32, "0" * 16
SAMPLED = 0x01  # the one flag version 00 defines; we emit no other bit ("Vendors MUST set those to zero")
OWS = " \t"

# tracestate: key = (lcalpha / DIGIT) 0*255(keychar); value = 0*255(chr) nblk-chr, printable ASCII
# without "," and "=", not ending in a space.
_TS_KEY = re.compile(r"[a-z0-9][a-z0-9_\-*/@]{0,255}")
_TS_VALUE = re.compile(r"[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]")
MAX_MEMBERS = 32
MAX_TRACESTATE = 512  # the spec's floor for what a vendor propagates; entries are dropped whole above it
LONG_MEMBER = 128  # entries longer than this are the first to go when truncating
MAX_FORWARDED = 8192  # a header passed through unparsed is refused only when prohibitively large
_HEADER_TEXT = re.compile(r"[\x20-\x7e\t]*")  # what may go into a request head as it is


class TraceParent(NamedTuple):
    version: int
    trace_id: str  # 32 lowercase hex digits, never all zero
    span_id: str  # 16 lowercase hex digits (the caller's span: our parent), never all zero
    flags: int

    @property
    def sampled(self) -> bool:
        return bool(self.flags & SAMPLED)


def parse_traceparent(value: str | None) -> TraceParent | None:
    """The caller's trace context, or None when absent or invalid (the trace then restarts).

    Version 00 is exactly 55 characters. A higher version (never `ff`) is read for its first four
    fields, which must be followed by the end or a dash; whatever follows is not ours to read."""
    m = _valid(value.strip(OWS)) if value else None
    if m is None:
        return None
    version, trace_id, span_id, flags = m.groups()
    return TraceParent(int(version, 16), trace_id, span_id, int(flags, 16))


def _valid(value: str) -> re.Match | None:
    m = _TRACEPARENT.match(value)
    if m is None:
        return None
    version, trace_id, span_id, _flags = m.groups()
    if version == "ff" or trace_id == _ZERO_TRACE or span_id == _ZERO_SPAN:
        return None
    if len(value) != 55 and (version == "00" or value[55] != "-"):
        return None
    return m


def format_traceparent(trace_id: int | str, span_id: int | str, sampled: bool) -> str:
    """A version-00 header for the span `span_id` of trace `trace_id` (ints as OpenTelemetry holds
    them, or hex strings)."""
    t = trace_id if isinstance(trace_id, str) else f"{trace_id:032x}"
    s = span_id if isinstance(span_id, str) else f"{span_id:016x}"
    return f"00-{t}-{s}-{'01' if sampled else '00'}"


def clean_tracestate(value: str | None) -> str | None:
    """The list-members of a `tracestate` worth passing on, in order: invalid members and repeats of a
    key dropped (the leftmost is the latest position), at most 32, and at most 512 characters (the
    longest entries go first, then from the end). None when nothing is left."""
    if not value:
        return None
    members: list[tuple[str, str]] = []
    seen: set[str] = set()
    for raw in value.split(","):
        raw = raw.strip(OWS)
        if not raw:
            continue  # empty members are allowed, and carry nothing
        key, sep, val = raw.partition("=")
        if not sep or key in seen or not _TS_KEY.fullmatch(key) or not _TS_VALUE.fullmatch(val):
            continue
        seen.add(key)
        members.append((key, raw))
    members = members[:MAX_MEMBERS]
    if sum(len(m) for _k, m in members) + len(members) - 1 > MAX_TRACESTATE:
        members = [m for m in members if len(m[1]) <= LONG_MEMBER]
        while members and sum(len(m) for _k, m in members) + len(members) - 1 > MAX_TRACESTATE:
            members.pop()
    return ",".join(m for _k, m in members) or None


def forwardable(traceparent: str | None, tracestate: str | None) -> tuple[str, str | None] | None:
    """What a process that does not trace passes on unchanged (the spec's forwarding mode): the
    caller's headers as received when the traceparent is valid, else nothing. The tracestate goes
    with it untouched (an unchanged traceparent must keep its tracestate), unless it is not
    printable ASCII or prohibitively large."""
    if not traceparent:
        return None
    traceparent = traceparent.strip(OWS)
    if _valid(traceparent) is None:
        return None
    if len(traceparent) > 55 and (len(traceparent) > MAX_FORWARDED or not _HEADER_TEXT.fullmatch(traceparent)):
        return None  # a higher version's unknown fields, passed on only if they fit in a request head
    state = tracestate.strip(OWS) if tracestate else None
    if state and (len(state) > MAX_FORWARDED or not _HEADER_TEXT.fullmatch(state)):
        state = None
    return traceparent, state or None
