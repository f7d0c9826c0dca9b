"""What the gateways count per tenant (API key) of each model, for fair queueing (gateway.routing.fairness)
and for `llmgw usage` and the console. Pure: the store's `tenants` aggregate reads and writes them.

Every gateway process adds what it counted since its last flush (`TenantDelta`) to one hash per model,
`llmgw:tenants:<model>`, and reads the totals back in the same round trip (`TenantTotals`): what every
process flushed so far. A field is `<column>:<key id>`, the columns below.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple

from llmgw.state.keypolicy import ANONYMOUS, DEFAULT_WEIGHT, ApiKeyRecord

SHARE_MINUTES = 5  # the minutes a key's recent share is taken over (this one, partly, and the four before)


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


def service_rows(keys: Mapping[str, ApiKeyRecord], totals: Mapping[str, Mapping[str, TenantTotals]],
                 minutes: Mapping[str, Mapping[int, Mapping[str, str]]]) -> list[dict]:
    """Rows {key, id, model, weight, service_tokens, requests, mean_wait, share} per key and model, for
    `llmgw usage` and the console: the service fair queueing counted (tokens: prompt tokens computed
    + output weight x tokens generated), the requests sent, the mean seconds a request waited in the
    gateways' queues (what waited, over what was sent), and the key's share of the model's service
    over the per-minute hashes given (None: no service then). `keys`: the live keys by id."""
    rows = []
    for model in sorted(totals):
        shares = recent_shares(minutes.get(model, {}))
        for kid, t in sorted(totals[model].items()):
            k = keys.get(kid)
            name = k.name if k is not None else kid + ("" if kid == ANONYMOUS else " (revoked)")
            rows.append({"key": name, "id": kid, "model": model,
                         "weight": k.weight if k is not None else DEFAULT_WEIGHT,
                         "service_tokens": round(t.tokens), "requests": t.requests,
                         "mean_wait": round(t.wait / t.requests, 4) if t.requests else None,
                         "share": round(shares[kid], 4) if kid in shares else None})
    return sorted(rows, key=lambda r: (r["key"], r["model"]))
