"""Catalog validation: a catalog document (as loaded from YAML) checked and resolved into `Catalog`.

`parse_catalog(data, source)` returns a `Catalog` or raises `CatalogInvalid` listing every problem at
once, each with its field path, so a catalog that would fail later (a vLLM profile without a GPU, a
GPU count that cannot hold the parallelism, a typo in a key) is refused before it is applied. The
returned catalog is fully resolved: top-level `defaults:` and the per-engine defaults are folded into
every profile, so readers never apply defaults themselves. What an engine can run (its parallelism,
the model sources it loads) is asked of its engine driver (`llmgw.engines`): no engine is named here.
"""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import ValidationError

from llmgw.catalog import lora
from llmgw.catalog.problems import KNOWN_KEYS, PROFILE_FIELDS, describe, join_path, pydantic_problems
from llmgw.catalog.types import ENGINE_DEFAULTS, ENGINE_NAMES, Catalog, Model, Profile
from llmgw.engines import ENGINES
from llmgw.errors import CatalogInvalid, Problem

MERGED_MAPS = ("env", "node_selector", "gpu")


# Flags llmgw sets itself on every engine command line; passing them in `args` would fight the
# engine driver (two --port flags, a served name the router does not know, parallelism the GPU
# allocation does not match).
_RESERVED_ARGS: dict[str, str] = {
    "--host": "llmgw binds each replica itself (LLMGW_ENGINE_HOST)",
    "--port": "llmgw gives each replica its own port",
    "--served-model-name": "llmgw serves the model under its name and aliases",
    "-a": "llmgw serves the model under its name and aliases",
    "--alias": "llmgw serves the model under its name and aliases",
    "-m": "the model file comes from the model's `source`",
    "--model": "the model comes from the model's `source`",
    "-tp": "use the profile's `tensor_parallel`",
    "--tensor-parallel-size": "use the profile's `tensor_parallel`",
    "-pp": "use the profile's `pipeline_parallel`",
    "--pipeline-parallel-size": "use the profile's `pipeline_parallel`",
    "--nnodes": "use the profile's `nodes`",
    "-np": "set the profile's `capacity` instead (llmgw passes it to llama-server as -np)",
    "--parallel": "set the profile's `capacity` instead (llmgw passes it to llama-server as -np)",
    "--node-rank": "llmgw assigns node ranks to multi-node replicas",
    "--master-addr": "llmgw sets the head address of multi-node replicas",
    "--api-key": "the gateway authenticates clients; an engine key would refuse the gateway's own requests",
}
_RESERVED_ENV: dict[str, str] = {
    "CUDA_VISIBLE_DEVICES": "llmgw pins each replica to the GPUs it allocated",
}

# --- the rules ---------------------------------------------------------------------------------


# A profile has a fixed replica count or autoscales: the one it names itself wins over the other
# from `defaults:`.
_COUNT_KEYS = ("replicas", "autoscale")
BOTH_COUNTS = ("`replicas` and `autoscale` together: a profile has a fixed replica count or autoscales "
               "within [min, max], not both (remove one)")


def _names_count(d: dict, key: str) -> bool:
    return d.get(key) is not None


def _merge_defaults(defaults: dict, profile: dict) -> dict:
    if any(_names_count(profile, k) for k in _COUNT_KEYS):
        defaults = {k: v for k, v in defaults.items() if k not in _COUNT_KEYS}
    merged = {**defaults, **profile}
    for key in MERGED_MAPS:
        d, p = defaults.get(key), profile.get(key)
        if isinstance(d, dict) and isinstance(p, dict):
            merged[key] = {**d, **p}
    return merged


def _validate_defaults(raw: Any, problems: list[Problem]) -> dict:
    """The valid part of `defaults:`; each invalid key is reported once, here, and not merged."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        problems.append(Problem("defaults", f"must be a mapping of profile fields, got {describe(raw)}"))
        return {}
    out = dict(raw)
    for key, why in (("name", "a profile's name cannot have a default"),
                     ("source", "a source belongs to a model (or one profile), it cannot have a default"),
                     ("url", "a url belongs to one external profile, it cannot have a default"),
                     ("served_name", "a served name belongs to one external profile, it cannot have a default")):
        if key in out:
            problems.append(Problem(f"defaults.{key}", why))
            del out[key]
    if all(_names_count(out, k) for k in _COUNT_KEYS):
        problems.append(Problem("defaults.autoscale", BOTH_COUNTS))
        del out["autoscale"]
    probe = {"engine": "sim", **out, "name": "defaults"}
    try:
        Profile.model_validate(probe)
    except ValidationError as e:
        bad = set()
        for p, err in zip(pydantic_problems(e, "defaults", "profile"), e.errors(include_url=False)):
            problems.append(p)
            bad.add(err["loc"][0])
        out = {k: v for k, v in out.items() if k not in bad}
    return out


def _args_problems(args: list[str], path: str) -> list[Problem]:
    out = []
    for i, arg in enumerate(args):
        flag = arg.split("=", 1)[0]
        if flag in _RESERVED_ARGS:
            out.append(Problem(f"{path}[{i}]", f"'{flag}' is set by llmgw: {_RESERVED_ARGS[flag]}"))
    return out


def _field_problems(rawp: dict, engine: str, path: str) -> tuple[list[Problem], set[str]]:
    """The fields a profile writes that its engine refuses (its engine driver says why), and their names;
    they are left out of the profile so no further problem is reported about them. A field written
    with the value the profile would have anyway is no problem: a resolved catalog (every default
    spelled out, as stored) validates as it is."""
    driver = ENGINES[engine]
    problems, refused = [], set()
    for key, value in rawp.items():
        # Unknown keys are pydantic's to report (with a hint when they look like a credential).
        if key not in PROFILE_FIELDS or value == _neutral(engine, key):
            continue
        why = driver.field_refusal(key)
        if why:
            problems.append(Problem(f"{path}.{key}", why))
            refused.add(key)
    return problems, refused


def _neutral(engine: str, key: str) -> Any:
    """What a profile of `engine` has in `key` when it does not say."""
    if key in ENGINE_DEFAULTS.get(engine, {}):
        return ENGINE_DEFAULTS[engine][key]
    return Profile.model_fields[key].get_default(call_default_factory=True)


def _applicable(defaults: dict, engine: Any) -> dict:
    """The `defaults:` an engine's profiles take: those its engine driver does not refuse (an external
    profile does not inherit `replicas`, `gpu` or `env` meant for the engines llmgw runs)."""
    if not isinstance(engine, str) or engine not in ENGINE_NAMES:
        return defaults
    driver = ENGINES[engine]
    return {k: v for k, v in defaults.items() if not driver.field_refusal(k)}


def _profile_problems(p: Profile, path: str) -> list[Problem]:
    """Rules across fields of one profile: the engine's own (parallelism, GPUs) come from its engine driver,
    then llmgw's reserved flags and variables."""
    driver = ENGINES[p.engine]
    try:
        refusals = list(driver.refusals(p))
    except Exception as e:  # noqa: BLE001 - a broken driver check is a problem to report, not a crash
        refusals = [Problem("", f"the {p.engine} engine driver could not check this profile: {e!r}")]
    problems = [Problem(join_path(path, r.path), r.reason) for r in refusals]
    problems += _autoscale_problems(p, f"{path}.autoscale")
    problems += _args_problems(p.args, f"{path}.args")
    for key in p.env:
        if key in _RESERVED_ENV:
            problems.append(Problem(f"{path}.env.{key}", f"'{key}' is set by llmgw: {_RESERVED_ENV[key]}"))
    return problems


def _autoscale_problems(p: Profile, path: str) -> list[Problem]:
    """The rules across `autoscale` fields, each at the field it is about."""
    a = p.autoscale
    if a is None:
        return []
    out = []
    if a.min > a.max:
        out.append(Problem(f"{path}.min", f"min {a.min} is above max {a.max}"))
    if a.idle_after is not None and a.min > 0:
        out.append(Problem(f"{path}.idle_after", f"only applies with min: 0 (scale to zero); with min {a.min} the "
                                                 "profile never goes idle to zero: remove it, or set min: 0"))
    return out


# Fields the cross-field rules read: when one of them is itself invalid, those rules are skipped
# rather than reporting consequences of the first error.
_RULE_FIELDS = frozenset({"engine", "gpu", "tensor_parallel", "pipeline_parallel", "nodes"})


def _rules_despite(e: ValidationError, merged: dict, path: str) -> list[Problem]:
    """Cross-field problems of a profile that also has type errors, so all are reported at once."""
    bad = {err["loc"][0] for err in e.errors(include_url=False) if err["loc"]}
    if bad & _RULE_FIELDS:
        return []
    try:
        profile = Profile.model_validate({k: v for k, v in merged.items() if k not in bad})
    except ValidationError:
        return []
    out = []
    for p in _profile_problems(profile, path):
        field = p.path[len(path) + 1:].split(".")[0].split("[")[0]
        if field not in bad:
            out.append(p)
    return out


def _source_problems(source: Any, engine: str, path: str, profile_name: str = "") -> list[Problem]:
    """Whether `engine` can load `source` (its engine driver says); `profile_name` is set when the source is
    the model's."""
    if not isinstance(source, str):
        return []  # already reported as a type error
    return ENGINES[engine].source_problems(source, path, profile_name)


def _name_problems(models: list[Any]) -> list[Problem]:
    """Model names unique; aliases unique across every name and alias of the catalog."""
    problems: list[Problem] = []
    owner: dict[str, str] = {}  # name -> path of the model it names
    for i, m in enumerate(models):
        name = m.get("name") if isinstance(m, dict) else None
        if isinstance(name, str) and name:
            if name in owner:
                problems.append(Problem(f"models[{i}].name", f"duplicate model name {name!r} (also {owner[name]})"))
            else:
                owner[name] = f"models[{i}]"
    alias_owner: dict[str, str] = {}
    for i, m in enumerate(models):
        if not isinstance(m, dict) or not isinstance(m.get("aliases"), list):
            continue
        own = m.get("name")
        for k, alias in enumerate(m["aliases"]):
            if not isinstance(alias, str) or not alias:
                continue
            path = f"models[{i}].aliases[{k}]"
            if alias == own:
                problems.append(Problem(path, f"alias {alias!r} is the model's own name"))
            elif alias in owner:
                problems.append(Problem(path, f"alias {alias!r} is the name of {owner[alias]}"))
            elif alias in alias_owner:
                other = alias_owner[alias]
                where = "listed twice" if other.startswith(f"models[{i}].") else f"also an alias at {other}"
                problems.append(Problem(path, f"alias {alias!r} is {where}"))
            else:
                alias_owner[alias] = path
    return problems


def parse_catalog(data: Any, source: str = "<catalog>") -> Catalog:
    """Validate a catalog document (as loaded from YAML) and resolve its defaults.

    Raises CatalogInvalid with every problem found, each with its field path."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise CatalogInvalid(source, [Problem("", f"the catalog must be a mapping with a `models` list, got {describe(data)}")])
    problems: list[Problem] = []
    for key in data:
        if key not in KNOWN_KEYS["catalog"]:
            close = difflib.get_close_matches(str(key), KNOWN_KEYS["catalog"], n=1, cutoff=0.6)
            hint = f" (did you mean '{close[0]}'?)" if close else " (known: models, defaults)"
            problems.append(Problem(str(key), f"unknown field '{key}'{hint}"))
    defaults = _validate_defaults(data.get("defaults"), problems)
    raw_models = data.get("models", [])
    if raw_models is None:
        raw_models = []
    if not isinstance(raw_models, list):
        problems.append(Problem("models", f"must be a list, got {describe(raw_models)}"))
        raw_models = []

    models: list[Model] = []
    for i, raw in enumerate(raw_models):
        mpath = f"models[{i}]"
        if not isinstance(raw, dict):
            problems.append(Problem(mpath, f"must be a mapping (name, source, profiles), got {describe(raw)}"))
            continue
        header = None
        try:
            header = Model.model_validate({k: v for k, v in raw.items() if k != "profiles"})
        except ValidationError as e:
            problems += pydantic_problems(e, mpath, "model")
        raw_profiles = raw.get("profiles", [])
        if not isinstance(raw_profiles, list):
            problems.append(Problem(f"{mpath}.profiles", f"must be a list, got {describe(raw_profiles)}"))
            raw_profiles = []
        if not raw_profiles:
            problems.append(Problem(f"{mpath}.profiles", "a model needs at least one profile (use replicas: 0 to keep it idle)"))
        profiles: list[Profile] = []
        seen: dict[str, int] = {}
        for j, rawp in enumerate(raw_profiles):
            ppath = f"{mpath}.profiles[{j}]"
            if not isinstance(rawp, dict):
                problems.append(Problem(ppath, f"must be a mapping of profile fields, got {describe(rawp)}"))
                continue
            pname = rawp.get("name")
            if isinstance(pname, str) and pname:
                if pname in seen:
                    problems.append(Problem(f"{ppath}.name", f"duplicate profile name {pname!r} (also profiles[{seen[pname]}])"))
                else:
                    seen[pname] = j
            if all(_names_count(rawp, k) for k in _COUNT_KEYS):
                problems.append(Problem(f"{ppath}.autoscale", BOTH_COUNTS))
            engine = rawp.get("engine", defaults.get("engine"))
            merged = _merge_defaults(_applicable(defaults, engine), rawp)
            if isinstance(engine, str) and engine in ENGINE_NAMES:
                refusals, refused = _field_problems(rawp, engine, ppath)
                problems += refusals
                merged = {k: v for k, v in merged.items() if k not in refused}
            try:
                profile = Profile.model_validate(merged)
                problems += _profile_problems(profile, ppath)
                profiles.append(profile)
            except ValidationError as e:
                problems += pydantic_problems(e, ppath, "profile")
                problems += _rules_despite(e, merged, ppath)
            if isinstance(engine, str) and engine in ENGINE_NAMES:
                if merged.get("source") is not None:
                    problems += _source_problems(merged["source"], engine, f"{ppath}.source")
                else:
                    pname = rawp.get("name") if isinstance(rawp.get("name"), str) else f"#{j}"
                    problems += _source_problems(raw.get("source", ""), engine, f"{mpath}.source", pname)
        if header is not None and len(profiles) == len(raw_profiles):
            model = header.model_copy(update={"profiles": profiles})
            problems += lora.model_problems(model, mpath)
            models.append(model)
    problems += _name_problems(raw_models)
    problems += lora.name_problems(raw_models)
    if problems:
        raise CatalogInvalid(source, problems)
    return Catalog(models=models)
