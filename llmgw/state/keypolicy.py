"""Gateway API keys and their policy: the record type, parsing the flags that set it, validation,
and what a key's usage and budget say. Pure: the store's `apikeys` aggregate reads and writes them.

A key is shown once, at creation; Redis keeps only its SHA-256 (`hash_key`). Besides its limits (rpm,
tpm, priority) a record carries its policy: the models it may call (names or aliases; empty = all),
when it expires, a token budget per UTC day or month, and whether it is an admin key. The gateway's
decision over them is `gateway.policy.decide`; `llmgw keys create|update` and the console's keys page
read their values with `key_changes` (`parse_models`, `parse_expires`, `parse_tokens`, `parse_weight`),
and say what a key may do with `describe_key`.

A key is also a tenant of a saturated model (gateway.routing.fairness): its `weight` is its share
against the other keys waiting for the same model, and a key marked `sub_tenants` (a trusted front
end) may split its share among the sub-tenants it names in `X-LLMGW-Tenant` (`tenant_of`).

How the engines order a request (`order_rank`: its class as vLLM's `priority`) and the prefix-cache
salt of a key that isolates its cache (`cache_salt_of`) are decided here too, beside the classes.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import secrets
import typing
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from typing import Callable, Literal, Mapping, NamedTuple

from llmgw.errors import LlmgwError
from llmgw.slo import LONGEST, BadDuration, Targets, parse_duration
from llmgw.state.budget import BUDGET_PERIODS, DEFAULT_BUDGET_PERIOD, Period, iso, period_of

# A request's criticality, highest first; `batch` is a Batch API line's (workers/batch), below every
# interactive class: shed first at saturation, and evicted first (gateway.routing.eviction).
Priority = Literal["critical", "standard", "sheddable", "batch"]
PRIORITIES: tuple[str, ...] = typing.get_args(Priority)
PRIORITY_RANK = {"batch": -1, "sheddable": 0, "standard": 1, "critical": 2}
KEY_PREFIX = "sk-llmgw-"
# The key id under which gateways count usage of requests served while no key was required.
ANONYMOUS = "anonymous"
# A key's share of a saturated model against the other keys' (gateway.routing.fairness): the default,
# and the range `--weight` accepts (a ratio of 10^5 between two keys is already starvation).
DEFAULT_WEIGHT = 1.0
MIN_WEIGHT, MAX_WEIGHT = 0.01, 1000.0
# The header a trusted front end names a sub-tenant of its key with, and the longest name it takes.
TENANT_HEADER = "X-LLMGW-Tenant"
MAX_SUB_TENANT = 64
# The classes in the order the engines receive (vLLM's `priority`: lower first; `order_rank`): PRIORITY_RANK
# turned round, with the default class, `standard`, at vLLM's default 0, so a standard request's body
# needs no field: critical -1, standard 0, sheddable 1, and a Batch API line (`batch`) 2, last of all.
ORDER_RANK = {p: PRIORITY_RANK["standard"] - r for p, r in PRIORITY_RANK.items()}


class ApiKeyInvalid(LlmgwError):
    """A bad argument for a new API key (names the flag and the reason)."""


@dataclass(frozen=True)
class ApiKeyRecord:
    """One stored key: never the key itself, only its hash."""

    id: str
    name: str
    hash: str = ""
    rpm: int | None = None
    tpm: int | None = None
    priority: str | None = None  # the highest criticality this key's requests may claim
    created_at: float = 0.0
    models: tuple[str, ...] = ()  # model names or aliases this key may call; empty: every model
    expires_at: float | None = None  # epoch seconds; from then on the key is refused (401)
    budget: int | None = None  # tokens (prompt + completion) per budget_period
    budget_period: str | None = None  # "day" | "month" (UTC), set when budget is
    admin: bool = False  # may call the admin APIs (the console); never implied by anything else
    weight: float = DEFAULT_WEIGHT  # its share of a saturated model against the other keys' (fairness)
    sub_tenants: bool = False  # may name sub-tenants in X-LLMGW-Tenant (a trusted front end)
    batches: bool = True  # may upload batch files and create batches (docs/batch.md)
    # Its requests' default latency targets in seconds (llmgw.slo; None: none), under their own headers.
    slo_ttft: float | None = None
    slo_tpot: float | None = None
    slo_deadline: float | None = None
    # Its requests carry a `cache_salt` of their own (`cache_salt_of`): they share no prefix-cache entry
    # with other keys' on the engines that take one (vLLM, the sim).
    isolate_cache: bool = False

    def slo(self) -> Targets | None:
        """Its requests' default latency targets, or None when it sets none."""
        if self.slo_ttft is None and self.slo_tpot is None and self.slo_deadline is None:
            return None
        return Targets(self.slo_ttft, self.slo_tpot, self.slo_deadline)

    def to_json(self) -> str:
        d = asdict(self)
        d.pop("id")
        d["models"] = list(self.models)
        return json.dumps(d)

    @classmethod
    def from_json(cls, key_id: str, blob: str) -> "ApiKeyRecord":
        """Raises ValueError on a malformed record."""
        try:
            d = json.loads(blob)
            if not isinstance(d, dict) or not isinstance(d.get("hash"), str):
                raise ValueError("no 'hash'")
            prio = d.get("priority")
            if prio is not None and prio not in PRIORITIES:
                raise ValueError(f"bad priority {prio!r}")
            models = d.get("models") or []
            if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
                raise ValueError(f"bad models {models!r}")
            period = d.get("budget_period")
            if period is not None and period not in BUDGET_PERIODS:
                raise ValueError(f"bad budget_period {period!r}")
            budget = _pos_int(d.get("budget"))
            expires = d.get("expires_at")
            weight = float(d.get("weight", DEFAULT_WEIGHT))
            if not MIN_WEIGHT <= weight <= MAX_WEIGHT:
                raise ValueError(f"bad weight {weight!r}")
            slo = {f: _seconds(d.get(f), f) for f in SLO_FIELDS}
            return cls(id=key_id, name=str(d.get("name") or key_id), hash=d["hash"],
                       rpm=_pos_int(d.get("rpm")), tpm=_pos_int(d.get("tpm")), priority=prio,
                       created_at=float(d.get("created_at") or 0.0), models=tuple(models),
                       expires_at=None if expires is None else float(expires), budget=budget,
                       budget_period=(period or DEFAULT_BUDGET_PERIOD) if budget else None,
                       admin=d.get("admin") is True, weight=weight, sub_tenants=d.get("sub_tenants") is True,
                       batches=d.get("batches") is not False, isolate_cache=d.get("isolate_cache") is True, **slo)
        except (TypeError, ValueError) as e:
            raise ValueError(f"API key record {key_id}: {e}") from None

    def public(self) -> dict:
        """What `llmgw keys list` shows: everything but the hash."""
        d = asdict(self)
        d.pop("hash")
        d["models"] = list(self.models)
        return d

    def period(self, now: float) -> Period | None:
        """The budget period holding `now`, for a key with a budget."""
        return period_of(self.budget_period or DEFAULT_BUDGET_PERIOD, now) if self.budget else None


def _pos_int(v) -> int | None:
    return None if v is None else int(v)


def _seconds(v, field: str) -> float | None:
    if v is None:
        return None
    v = float(v)
    if not 0 < v <= LONGEST:
        raise ValueError(f"bad {field} {v!r}")
    return v


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class Tenant(NamedTuple):
    """Who a request is served for when its model is saturated (gateway.routing.fairness): its key
    (`ANONYMOUS` without one), the key's name (the metrics' label), the key's weight, and the
    sub-tenant a trusted front end named ("" none). A tuple: one is made per request."""

    key: str
    name: str
    weight: float = DEFAULT_WEIGHT
    sub: str = ""


class TenantRefused(NamedTuple):
    """Why a request's `X-LLMGW-Tenant` is refused: `untrusted` (its key may not name sub-tenants)
    or `malformed`."""

    kind: str
    message: str


def tenant_of(key: ApiKeyRecord | None, header: str | None) -> Tenant | TenantRefused:
    """The tenant of a request with `key` (None: no key is required) and the `X-LLMGW-Tenant` value
    it sent, or why the header is refused. Only a key marked `sub_tenants` may name one (without
    keys every client is trusted alike); the name is 1..MAX_SUB_TENANT printable ASCII characters."""
    if header is not None:
        if key is not None and not key.sub_tenants:
            return TenantRefused("untrusted", f"API key {key.name!r} may not name sub-tenants in {TENANT_HEADER} "
                                              f"(a trusted front end's key may: llmgw keys update {key.name} "
                                              "--sub-tenants)")
        if not 0 < len(header) <= MAX_SUB_TENANT or not all(" " < ch <= "~" for ch in header):
            return TenantRefused("malformed", f"{TENANT_HEADER} must be 1 to {MAX_SUB_TENANT} printable ASCII "
                                              f"characters without spaces, got {header[:80]!r}")
    if key is None:
        return Tenant(ANONYMOUS, ANONYMOUS, DEFAULT_WEIGHT, header or "")
    return Tenant(key.id, key.name, key.weight, header or "")


def order_rank(priority: str) -> int:
    """Where a request of class `priority` stands in the gateway's order, as an engine's `priority`
    (lower first, vLLM's sense): critical -1, standard 0 (the engines' default), sheddable 1, batch 2.
    An unknown class ranks as standard."""
    return ORDER_RANK.get(priority, 0)


# What a key's cache salt is made from besides the key: fixed, so a key's salt never changes.
_SALT_DOMAIN = b"llmgw-cache-salt\0"


def cache_salt_of(key: ApiKeyRecord | None) -> str | None:
    """The `cache_salt` a key's requests carry when it isolates its prefix cache (None: they carry
    none, and share cached prefixes with every other key's). Derived from the key's id and its hash:
    stable for the key's life (neither ever changes), the same in every gateway process, and
    unguessable by other tenants (it takes the key's hash, which only Redis and the key's holder can
    make), while it reveals nothing of the key (a SHA-256 over its SHA-256). 32 hex characters with a
    prefix: within vLLM's limits (at most 128 characters, no '@', '/', '\\')."""
    if key is None or not key.isolate_cache:
        return None
    digest = hashlib.sha256(_SALT_DOMAIN + key.id.encode() + b"\0" + key.hash.encode()).hexdigest()
    return "llmgw-" + digest[:32]


def cap_priority(requested: str, ceiling: str) -> str:
    """The lower of two criticalities: a key's requests can lower their priority, never raise it."""
    return requested if PRIORITY_RANK[requested] <= PRIORITY_RANK[ceiling] else ceiling


# --- the flags of `llmgw keys create|update` -----------------------------------------------------
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_TOKENS = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*$")
_SCALE = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}


def parse_models(text: str) -> tuple[str, ...]:
    """`--models a,b`: names or aliases, in order, without repeats; `all` (or empty) = every model."""
    if text.strip().lower() in ("", "all"):
        return ()
    names = [n.strip() for n in text.split(",")]
    if any(not n for n in names):
        raise ApiKeyInvalid(f"--models: expected model names separated by commas, got {text!r}")
    return tuple(dict.fromkeys(names))


def parse_expires(text: str, now: float) -> float:
    """`--expires`: a duration from now (`30d`, `12h`, `90m`, `45s`, `2w`) or an ISO date or time
    (`2025-12-31` is 00:00 UTC that day; a time without an offset is UTC). Returns epoch seconds."""
    m = _DURATION.match(text)
    if m:
        at = now + float(m.group(1)) * _UNIT[m.group(2)]
    else:
        try:
            t = datetime.fromisoformat(text.strip())
        except ValueError:
            raise ApiKeyInvalid(f"--expires: expected a duration such as 30d, 12h or 90s, or an ISO date such "
                                f"as 2026-01-31, got {text!r}") from None
        at = (t if t.tzinfo else t.replace(tzinfo=timezone.utc)).timestamp()
    if at <= now:
        raise ApiKeyInvalid(f"--expires: {iso(at)} is not in the future")
    return at


def parse_weight(text: str) -> float:
    """`--weight`: a key's share of a saturated model against the other keys' (default 1)."""
    try:
        w = float(text)
    except ValueError:
        raise ApiKeyInvalid(f"--weight: expected a number such as 1, 2 or 0.5, got {text!r}") from None
    if not MIN_WEIGHT <= w <= MAX_WEIGHT:
        raise ApiKeyInvalid(f"--weight: must be between {MIN_WEIGHT:g} and {MAX_WEIGHT:g}, got {text!r}")
    return w


def parse_target(text: str, field: str = "slo_ttft") -> float:
    """`--slo-ttft`, `--slo-tpot`, `--slo-deadline`: a duration with its unit (`500ms`, `0.5s`, `2s`)."""
    try:
        return parse_duration(text)
    except BadDuration as e:
        raise ApiKeyInvalid(f"{_flag(field)}: {e}") from None


def parse_tokens(text: str) -> int:
    """`--budget`: a token count, with an optional k, M or G suffix (powers of 1000): `5M`, `250k`."""
    m = _TOKENS.match(text)
    if not m:
        raise ApiKeyInvalid(f"--budget: expected a number of tokens such as 5M, 250k or 100000, got {text!r}")
    n = math.floor(float(m.group(1)) * _SCALE[m.group(2).lower()])
    if n <= 0:
        raise ApiKeyInvalid(f"--budget: must be at least one token, got {text!r}")
    return n


# The words that remove a limit or a policy in `update` (`--rpm none`, `--expires never`, `--models all`).
CLEAR = ("none", "never", "all")
# What `key_changes` reads: the flags of `llmgw keys create|update`, by their argparse names (the
# console's keys form sends the same names): text values, and booleans for the switches.
TEXT_FIELDS = ("rpm", "tpm", "priority", "models", "expires", "budget", "budget_period", "weight", "slo_ttft",
               "slo_tpot", "slo_deadline")
SLO_FIELDS = ("slo_ttft", "slo_tpot", "slo_deadline")  # a key's default latency targets (llmgw.slo)
SWITCHES = ("admin", "sub_tenants", "batches", "isolate_cache")
KEY_FIELDS = TEXT_FIELDS + SWITCHES


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def _text(values: Mapping[str, object], field: str) -> str | None:
    """A text flag's value; a number (the console's JSON) as its text; None when not given."""
    v = values.get(field)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (str, int, float)):
        raise ApiKeyInvalid(f"{_flag(field)}: expected text, got {v!r}")
    return str(v)


def _count(text: str | None, field: str) -> int | None:
    """An integer flag value (validated as positive with the record)."""
    if text is None or text.lower() in CLEAR:
        return None
    try:
        return int(text)
    except ValueError:
        raise ApiKeyInvalid(f"{_flag(field)}: expected an integer, got {text!r}") from None


def key_changes(values: Mapping[str, object], now: float) -> dict:
    """The record fields the given flag values set, for `llmgw keys create|update` and the console
    alike: only the flags given (None: not given); a CLEAR word sets None. Raises ApiKeyInvalid
    naming the flag. The record itself is validated when it is made (`new_key`, `updated`)."""
    out: dict = {}
    for field in ("rpm", "tpm"):
        text = _text(values, field)
        if text is not None:
            out[field] = _count(text, field)
    priority = _text(values, "priority")
    if priority is not None:
        out["priority"] = None if priority == "none" else priority
    models = values.get("models")
    if isinstance(models, (list, tuple)):  # the console may send a list
        if not all(isinstance(m, str) for m in models):
            raise ApiKeyInvalid(f"--models: expected model names, got {models!r}")
        models = ",".join(models) if models else "all"
    models = _text({"models": models}, "models")
    if models is not None:
        out["models"] = parse_models(models)
    expires = _text(values, "expires")
    if expires is not None:
        out["expires_at"] = None if expires.lower() in CLEAR else parse_expires(expires, now)
    budget = _text(values, "budget")
    if budget is not None:
        out["budget"] = None if budget.lower() in CLEAR else parse_tokens(budget)
    period = _text(values, "budget_period")
    if period is not None:
        out["budget_period"] = period
    weight = _text(values, "weight")
    if weight is not None:
        out["weight"] = parse_weight(weight)
    for field in SLO_FIELDS:
        text = _text(values, field)
        if text is not None:
            out[field] = None if text.lower() in CLEAR else parse_target(text, field)
    for field in SWITCHES:
        v = values.get(field)
        if v is not None:
            if not isinstance(v, bool):
                raise ApiKeyInvalid(f"{_flag(field)}: expected true or false, got {v!r}")
            out[field] = v
    return out


def unlisted_models(models, known) -> list[str]:
    """The names a key's `--models` lists that the applied catalog does not (yet): a typo, or a model
    still to come. Nothing when the catalog is empty."""
    return [m for m in models if m not in known] if known else []


def describe_key(rec: ApiKeyRecord) -> str:
    """What a key may do, in one line (`llmgw keys update`, the key events, the playground)."""
    parts = [f"models {','.join(rec.models) if rec.models else 'all'}",
             f"expires {iso(rec.expires_at) if rec.expires_at is not None else 'never'}",
             f"budget {f'{rec.budget} tokens per {rec.budget_period}' if rec.budget else 'none'}"]
    if rec.rpm or rec.tpm:
        parts.append(f"rpm {rec.rpm or '-'} tpm {rec.tpm or '-'}")
    if rec.priority:
        parts.append(f"priority {rec.priority}")
    parts.append(f"weight {rec.weight:g}")
    targets = rec.slo()
    if targets is not None:
        parts.append(f"targets {targets.describe()}")
    if rec.sub_tenants:
        parts.append("sub-tenants")
    if rec.admin:
        parts.append("admin")
    if not rec.batches:
        parts.append("no batches")
    if rec.isolate_cache:
        parts.append("isolated cache")
    return ", ".join(parts)


def validate_record(rec: ApiKeyRecord) -> None:
    """Raise ApiKeyInvalid naming the flag, for a record `keys create|update` is about to store."""
    if not rec.name or len(rec.name) > 100:
        raise ApiKeyInvalid("NAME: must be 1..100 characters")
    for v, flag in ((rec.rpm, "--rpm"), (rec.tpm, "--tpm"), (rec.budget, "--budget")):
        if v is not None and v <= 0:
            raise ApiKeyInvalid(f"{flag}: must be a positive integer, got {v}")
    if rec.priority is not None and rec.priority not in PRIORITIES:
        raise ApiKeyInvalid(f"--priority: expected one of {', '.join(PRIORITIES)}, got {rec.priority!r}")
    if rec.budget_period is not None and rec.budget_period not in BUDGET_PERIODS:
        raise ApiKeyInvalid(f"--budget-period: expected one of {', '.join(BUDGET_PERIODS)}, got {rec.budget_period!r}")
    if rec.budget_period is not None and rec.budget is None:
        raise ApiKeyInvalid("--budget-period: the key has no --budget")
    if any(not m or "," in m for m in rec.models):
        raise ApiKeyInvalid(f"--models: bad model name in {list(rec.models)}")
    if not isinstance(rec.weight, (int, float)) or not MIN_WEIGHT <= rec.weight <= MAX_WEIGHT:
        raise ApiKeyInvalid(f"--weight: must be between {MIN_WEIGHT:g} and {MAX_WEIGHT:g}, got {rec.weight!r}")
    for field in SLO_FIELDS:
        v = getattr(rec, field)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= LONGEST):
            raise ApiKeyInvalid(f"{_flag(field)}: must be a duration of more than 0 and at most 7 days, got {v!r}")
    if not isinstance(rec.isolate_cache, bool):
        raise ApiKeyInvalid(f"--isolate-cache: must be true or false, got {rec.isolate_cache!r}")


def validate(name: str, rpm: int | None, tpm: int | None, priority: str | None) -> None:
    validate_record(ApiKeyRecord("", name, rpm=rpm, tpm=tpm, priority=priority))


def new_key(name: str, rpm: int | None, tpm: int | None, priority: str | None, now: float,
            token: Callable[[int], str] = secrets.token_urlsafe,
            hexid: Callable[[int], str] = secrets.token_hex, **policy) -> tuple[ApiKeyRecord, str]:
    """A validated new record and the key it hashes (pure but for the injected randomness). `policy`:
    models, expires_at, budget, budget_period, admin, weight, sub_tenants, batches, isolate_cache (a
    budget without a period is per month)."""
    if policy.get("budget") and not policy.get("budget_period"):
        policy["budget_period"] = DEFAULT_BUDGET_PERIOD
    key = KEY_PREFIX + token(32)
    rec = ApiKeyRecord("k-" + hexid(4), name, hash_key(key), rpm, tpm, priority, now, **policy)
    validate_record(rec)
    return rec, key


# Fields `llmgw keys update` never changes: the key is the same key.
FIXED_FIELDS = frozenset({"id", "name", "hash", "created_at"})


def check_changes(changes: dict) -> dict:
    """The changes of `llmgw keys update` (fields of ApiKeyRecord) as they are applied: never a fixed
    field (ApiKeyInvalid); removing the budget removes its period."""
    if FIXED_FIELDS & set(changes):
        raise ApiKeyInvalid("a key's name, hash and creation time cannot be changed")
    if "budget" in changes and changes["budget"] is None:
        return {**changes, "budget_period": None}
    return dict(changes)


def updated(rec: ApiKeyRecord, changes: dict) -> ApiKeyRecord:
    """`rec` with `check_changes(changes)` made, validated; a budget without a period is per month."""
    new = replace(rec, **changes)
    if new.budget and not new.budget_period:
        new = replace(new, budget_period=DEFAULT_BUDGET_PERIOD)
    validate_record(new)
    return new


def parse_table(raw: dict[str, str]) -> tuple[list[ApiKeyRecord], list[str]]:
    """The records of an HGETALL of `keys.API_KEYS`, and one message per malformed one."""
    out, problems = [], []
    for kid, blob in raw.items():
        try:
            out.append(ApiKeyRecord.from_json(kid, blob))
        except ValueError as e:
            problems.append(str(e))
    return out, problems


def usage_by_model(raw: dict[str, str]) -> dict[str, dict[str, int]]:
    """A key's usage hash (`keys.usage`) as model -> {prompt_tokens, completion_tokens, requests}, and
    with latency targets (llmgw.slo) {slo_requests, slo_met}: the requests that had targets, and those
    of them that met them (goodput)."""
    per_model: dict[str, dict[str, int]] = {}
    for field, value in raw.items():
        model, _, kind = field.rpartition(":")
        col = _USAGE_COLUMNS.get(kind)
        if col:
            row = per_model.setdefault(model, {"prompt_tokens": 0, "completion_tokens": 0, "requests": 0})
            row[col] = int(value)
    return per_model


_USAGE_COLUMNS = {"prompt": "prompt_tokens", "completion": "completion_tokens", "requests": "requests",
                  "slo": "slo_requests", "slo_met": "slo_met"}


def budget_status(rec: ApiKeyRecord, used: int, now: float) -> dict | None:
    """What `llmgw usage` and `GET /v1/llmgw/usage` say about a key's budget in the current period."""
    period = rec.period(now)
    if period is None or rec.budget is None:
        return None
    return {"tokens": rec.budget, "period": rec.budget_period, "period_id": period.id,
            "used": used, "remaining": max(0, rec.budget - used), "resets_at": iso(period.end)}
