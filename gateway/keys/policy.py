"""What an API key may do, decided from the key record alone: `decide(key, model, used, now)`. Pure.

The gateway calls it on every proxied request with the record from its in-memory key table, the
requested model's names (its canonical name and aliases, so `--models` may list either), and the
tokens the key spent in its current budget period as this gateway knows them (its own answers at
once, every other gateway's within a usage flush; `gateway.keys.usage.UsageRecorder.spent`). No Redis.

In order: an expired key is refused (401) whatever it asks; a model the key may not call answers 404
with the body of a model that does not exist; a key whose budget is spent gets 429 with Retry-After
until its UTC period resets. A request is admitted while the spent tokens are below the budget, so
the request whose answer crosses it is the last one served.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Union

from llmgw.state.keypolicy import ApiKeyRecord
from llmgw.state.budget import iso


class ModelRef(NamedTuple):
    """The model a request names: the name as requested, and every name of that model. (A tuple: one
    is made per request, and a frozen dataclass costs five times as much to build.)"""

    requested: str
    names: frozenset[str]


@dataclass(frozen=True)
class Allow:
    pass


@dataclass(frozen=True)
class Deny:
    kind: str  # a gateway.errors kind: key_expired (401), model_not_found (404), budget_exceeded (429)
    message: str
    retry_after: int | None = None


Decision = Union[Allow, Deny]
ALLOW = Allow()


def unknown_model(name: str) -> str:
    """The one message of a model that does not exist, also for one a key may not call."""
    return f"model {name!r} does not exist"


def expired(key: ApiKeyRecord, now: float) -> Deny | None:
    if key.expires_at is not None and now >= key.expires_at:
        return Deny("key_expired", f"API key {key.name} expired at {iso(key.expires_at)}")
    return None


def allows(key: ApiKeyRecord, names: frozenset[str]) -> bool:
    """May `key` call the model known by `names`? A key without a list may call every model."""
    return not key.models or any(m in names for m in key.models)


def decide(key: ApiKeyRecord, model: ModelRef | None, used: int, now: float) -> Decision:
    """`model` None: a request about no model (listing models, reading usage): only expiry counts.
    `used`: tokens spent in the period holding `now` (ignored for a key without a budget)."""
    gone = expired(key, now)
    if gone is not None:
        return gone
    if model is None:
        return ALLOW
    if not allows(key, model.names):
        return Deny("model_not_found", unknown_model(model.requested))
    if key.budget is not None and used >= key.budget:
        period = key.period(now)
        assert period is not None
        return Deny("budget_exceeded",
                    f"API key {key.name} has spent {used} of its {key.budget} tokens this {key.budget_period} "
                    f"(UTC); the budget resets at {iso(period.end)}",
                    max(1, math.ceil(period.seconds_left(now))))
    return ALLOW
