"""What the gateways count per tenant (API key) of each model, for fair queueing (gateway.routing.fairness)
and for `llmgw usage` and the console. Pure: the store's `tenants` aggregate reads and writes them.

Every gateway process adds what it counted since its last flush (`TenantDelta`) to one hash per model,
`llmgw:tenants:<model>`, and reads the totals back in the same round trip (`TenantTotals`): what every
process flushed so far. A field is `<column>:<key id>`, the columns below.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple


class TenantDelta(NamedTuple):
    """What one gateway process counted for one key on one model since its last flush."""

    service: float  # counter units: tokens of service divided by the key's weight
    tokens: float  # tokens of service (prompt tokens computed + output weight x tokens generated)
    wait: float  # seconds its requests waited in the gateway's queue
    requests: int  # requests sent


class TenantTotals(NamedTuple):
    """What every gateway process flushed for one key on one model so far."""

    service: float = 0.0
    tokens: float = 0.0
    wait: float = 0.0
    requests: int = 0


COLUMNS = ("n", "t", "w", "r")  # service, tokens, wait, requests: the field prefixes, in TenantTotals' order


def field(column: str, key_id: str) -> str:
    return f"{column}:{key_id}"


def parse_totals(raw: Mapping[str, str]) -> dict[str, TenantTotals]:
    """A model's hash as key id -> TenantTotals; unreadable fields are skipped."""
    cols: dict[str, list[float]] = {}
    for name, value in raw.items():
        col, _, kid = name.partition(":")
        if col not in COLUMNS or not kid:
            continue
        try:
            v = float(value)
        except ValueError:
            continue
        cols.setdefault(kid, [0.0, 0.0, 0.0, 0.0])[COLUMNS.index(col)] = v
    return {k: TenantTotals(n, t, w, int(r)) for k, (n, t, w, r) in cols.items()}


def recent_shares(minutes: Mapping[int, Mapping[str, str]]) -> dict[str, float]:
    """Each key's share of a model's service over per-minute hashes (`<key id>` -> tokens)."""
    got: dict[str, float] = {}
    for raw in minutes.values():
        for kid, v in raw.items():
            try:
                got[kid] = got.get(kid, 0.0) + float(v)
            except ValueError:
                continue
    total = sum(got.values())
    return {k: v / total for k, v in got.items()} if total > 0 else {}
