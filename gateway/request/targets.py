"""The latency targets a request asks for in its headers (llmgw.slo): `asked(environ) -> Targets`, or a
400 naming the header whose value cannot be read.

    X-LLMGW-TTFT: 300ms       first byte within 300 ms of its arrival
    X-LLMGW-TPOT: 80ms        at most 80 ms per output token after the first
    X-LLMGW-Deadline: 60s     the whole answer within 60 s
    X-LLMGW-SLO: strict       refused at once (429) when predicted to miss them, not served late

What it does not ask it inherits from its key's defaults, then its model's (gateway.request.plan).
A request that sends none of these costs four dictionary lookups.
"""

from __future__ import annotations

from gateway.errors import ApiError
from llmgw.slo import NO_TARGETS, BadDuration, Targets, parse_duration

# (header, WSGI environ key, Targets field)
HEADERS = (("X-LLMGW-TTFT", "HTTP_X_LLMGW_TTFT", "ttft"), ("X-LLMGW-TPOT", "HTTP_X_LLMGW_TPOT", "tpot"),
           ("X-LLMGW-Deadline", "HTTP_X_LLMGW_DEADLINE", "deadline"))
MODE_HEADER, MODE_VAR = "X-LLMGW-SLO", "HTTP_X_LLMGW_SLO"
MODES = ("strict", "lax")  # lax: the default, served where its miss is smallest when none will meet them


def asked(environ: dict) -> Targets:
    """The targets the request's headers ask for (NO_TARGETS: none)."""
    ttft, tpot, deadline, mode = (environ.get("HTTP_X_LLMGW_TTFT"), environ.get("HTTP_X_LLMGW_TPOT"),
                                  environ.get("HTTP_X_LLMGW_DEADLINE"), environ.get(MODE_VAR))
    if ttft is None and tpot is None and deadline is None and mode is None:
        return NO_TARGETS
    values = {}
    for header, var, field in HEADERS:
        text = environ.get(var)
        if text is None:
            continue
        try:
            values[field] = parse_duration(text)
        except BadDuration as e:
            raise ApiError("invalid_value", f"{header}: {e}", param=header) from None
    strict = False
    if mode is not None:
        word = mode.strip().lower()
        if word not in MODES:
            raise ApiError("invalid_value", f"{MODE_HEADER}: expected one of {', '.join(MODES)}, got {mode[:80]!r}",
                           param=MODE_HEADER)
        strict = word == "strict"
    return Targets(strict=strict, **values)
