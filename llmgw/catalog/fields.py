"""The catalog's field primitives: name and metric patterns, strict numbers, durations, and the
base of every catalog model (frozen, unknown keys refused). `llmgw.catalog.types` builds on them."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Strict

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
METRIC_RE = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# Strict numbers: YAML's `replicas: yes` or `replicas: "2"` is a type error, not a silent coercion.
# (Strings are never coerced from numbers by pydantic; lists stay lax so Python callers may pass tuples.)
SInt = Annotated[int, Strict()]
SFloat = Annotated[float, Strict()]

# A duration: a number of seconds, or a string of units largest first: `5s`, `2m`, `1h30m`, `500ms`.
_DURATION_RE = re.compile(
    r"^(?:(?P<h>\d+(?:\.\d+)?)h)?(?:(?P<m>\d+(?:\.\d+)?)m(?!s))?(?:(?P<s>\d+(?:\.\d+)?)s)?"
    r"(?:(?P<ms>\d+(?:\.\d+)?)ms)?$"
)
_UNIT_SECONDS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}


def parse_duration(value: Any) -> float:
    """Seconds from a number or a string such as `90s`, `2m`, `1h30m`; ValueError says what is wrong."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        what = f"the boolean {str(value).lower()}" if isinstance(value, bool) else type(value).__name__
        raise ValueError(f"must be a duration (seconds, or a string like 5s, 2m, 1h30m), got {what}")
    if not isinstance(value, str):
        return float(value)
    m = _DURATION_RE.match(value.strip())
    if not value.strip() or m is None or not any(m.groupdict().values()):
        raise ValueError(f"{value!r} is not a duration: write seconds (30) or units largest first (5s, 2m, 1h30m, 500ms)")
    return sum(float(n) * _UNIT_SECONDS[u] for u, n in m.groupdict().items() if n)


Duration = Annotated[float, BeforeValidator(parse_duration)]


class StrictModel(BaseModel):
    """Frozen, resolved, and strict about keys: a misspelt field is an error, not ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)
