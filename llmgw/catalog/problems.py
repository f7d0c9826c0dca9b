"""Pydantic's validation errors turned into one clear line each: the field's path as the operator
wrote it, what was wrong, and for an unknown key the known ones (and the nearest, for a typo)."""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import ValidationError

from llmgw.catalog.routing import RoutingSpec, objective_reason
from llmgw.catalog.slo import SloSpec
from llmgw.catalog.types import ENGINE_NAMES, SERVER_KINDS, Adapter, Autoscale, LoraSlots, Profile
from llmgw.errors import Problem

PROFILE_FIELDS: tuple[str, ...] = tuple(Profile.model_fields)
KNOWN_KEYS: dict[str, tuple[str, ...]] = {
    "catalog": ("models", "defaults"),
    "model": ("name", "aliases", "source", "profiles", "adapters", "routing", "slo"),
    "profile": PROFILE_FIELDS,
    "adapter": tuple(Adapter.model_fields),
    "gpu": ("class", "count"),
    "metrics": ("running", "waiting", "kv_usage"),
    "autoscale": tuple(Autoscale.model_fields),
    "lora": tuple(LoraSlots.model_fields),
    "routing": tuple(RoutingSpec.model_fields),
    "slo": tuple(SloSpec.model_fields),
}


def describe(value: Any) -> str:
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, (int, float)):
        return f"the number {value}"
    if isinstance(value, str):
        return f"the string {value!r}"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, (list, tuple)):
        return "a list"
    return type(value).__name__


def _num(v: Any) -> Any:
    """1.0 reads as 1 in a message (a duration written `0s` arrives as 0.0)."""
    return f"{v:g}" if isinstance(v, float) else v


def _loc_to_path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if part == "[key]":
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def join_path(prefix: str, rest: str) -> str:
    if not rest:
        return prefix
    if not prefix:
        return rest
    return prefix + ("" if rest.startswith("[") else ".") + rest


def _known_for(loc: tuple[Any, ...], kind: str) -> tuple[str, ...]:
    parents = [p for p in loc[:-1] if isinstance(p, str)]
    if parents and parents[-1] in ("gpu", "metrics", "autoscale", "lora", "routing", "slo"):
        return KNOWN_KEYS[parents[-1]]
    if kind == "model" and parents and parents[0] in ("profiles", "adapters"):
        return KNOWN_KEYS[parents[0][:-1]]
    return KNOWN_KEYS.get(kind, ())


# Unknown keys that would hold a credential: the catalog is stored in Redis and shown by the CLI.
_KEY_LIKE = frozenset({"api_key", "apikey", "api-key", "key", "token", "api_token", "secret", "password",
                       "authorization", "bearer"})


def _reason(err: dict, kind: str) -> str:
    """One line a person can act on, from one pydantic error (never its wording or its URL)."""
    t, value, ctx = err["type"], err.get("input"), err.get("ctx") or {}
    loc = err["loc"]
    if t == "extra_forbidden":
        key = str(loc[-1])
        if key.lower() in _KEY_LIKE:
            return (f"unknown field '{key}': a key is never written in the catalog (it is stored in Redis); put it "
                    "in an environment variable of the gateway and name that variable in `api_key_env`")
        known = _known_for(loc, kind)
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        hint = f" (did you mean '{close[0]}'?)" if close else (f" (known: {', '.join(known)})" if known else "")
        return f"unknown field '{key}'{hint}"
    if t == "missing":
        return "required field is missing"
    if t == "literal_error" and loc and loc[-1] == "server":
        return f"unknown server {value!r} (expected one of: {', '.join(SERVER_KINDS)})"
    if t == "literal_error" and loc and loc[-1] == "objective":
        return objective_reason(value)
    if t == "literal_error":
        return f"unknown engine {value!r} (expected one of: {', '.join(ENGINE_NAMES)})"
    if t in ("int_type", "int_parsing", "int_from_float"):
        return f"must be a whole number, got {describe(value)}"
    if t in ("float_type", "float_parsing"):
        return f"must be a number, got {describe(value)}"
    if t == "string_type":
        where = "a key" if loc and loc[-1] == "[key]" else "a string"
        hint = " (quote it in YAML)" if isinstance(value, (int, float)) else ""
        return f"must be {where}, got {describe(value)}{hint}"
    if t in ("dict_type", "model_type", "model_attributes_type", "mapping_type"):
        return f"must be a mapping, got {describe(value)}"
    if t in ("list_type", "tuple_type"):
        return f"must be a list, got {describe(value)}"
    if t == "greater_than_equal":
        return f"must be at least {_num(ctx.get('ge'))}, got {_num(value)}"
    if t == "greater_than":
        return f"must be greater than {_num(ctx.get('gt'))}, got {_num(value)}"
    if t == "less_than_equal":
        return f"must be at most {_num(ctx.get('le'))}, got {_num(value)}"
    if t == "string_too_short":
        return "must not be empty"
    if t == "value_error":
        return str(ctx.get("error", err["msg"]))
    if t in ("finite_number",):
        return f"must be a finite number, got {value}"
    return str(err["msg"]).rstrip(".")


def pydantic_problems(e: ValidationError, prefix: str, kind: str) -> list[Problem]:
    return [
        Problem(join_path(prefix, _loc_to_path(err["loc"])), _reason(err, kind))
        for err in e.errors(include_url=False)
    ]
