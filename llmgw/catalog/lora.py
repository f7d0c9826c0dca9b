"""The catalog's rules for LoRA adapters, asked by `llmgw.catalog.validate.parse_catalog`.

`model_problems(model, path)` checks one model's adapters against the profiles that serve them
(each engine's driver says which sources and ranks it takes); `name_problems(raw_models)` checks
that no adapter name or alias collides with any model's or adapter's name or alias in the catalog.
Every problem is reported at the path of the field it is about.
"""

from __future__ import annotations

from typing import Any

from llmgw.catalog.types import Adapter, Model, Profile
from llmgw.engines import ENGINES
from llmgw.engines.base import PKG_SOURCE
from llmgw.errors import Problem

# Sources `llmgw.weights` downloads for models; an adapter's are not fetched (yet).
REMOTE_SCHEMES = ("hf://", "http://", "https://")


def _most_replicas(p: Profile) -> int:
    """The most replicas a profile may run: its fixed count, or `autoscale.max`."""
    return p.autoscale.max if p.autoscale else p.replicas


def _serving(model: Model, a: Adapter, path: str) -> tuple[list[Profile], list[Problem]]:
    """The profiles that serve adapter `a`, and what is wrong with the ones it names."""
    if not a.profiles:
        serving = [p for p in model.profiles if p.lora is not None]
        if serving:
            return serving, []
        return [], [Problem(path, f"no profile of model {model.name!r} serves LoRA adapters: give a vllm or llamacpp "
                                  "profile `lora: {max_loras: N}`")]
    serving, problems = [], []
    for i, name in enumerate(a.profiles):
        p = model.profile(name)
        where = f"{path}.profiles[{i}]"
        if p is None:
            known = ", ".join(q.name for q in model.profiles)
            problems.append(Problem(where, f"model {model.name!r} has no profile {name!r} (it has: {known})"))
        elif p.engine == "external":
            problems.append(Problem(where, f"profile {name!r} is engine: external: llmgw loads no adapter into a "
                                           "server it does not run"))
        elif p.lora is None:
            problems.append(Problem(where, f"profile {name!r} serves no adapters: give it `lora: {{max_loras: N}}`"))
        else:
            serving.append(p)
    return serving, problems


def _source_problems(a: Adapter, serving: list[Profile], path: str) -> list[Problem]:
    if a.source.startswith("pkg:") and not PKG_SOURCE.match(a.source):
        return [Problem(path, f"{a.source!r} must be written pkg:<package>/<file>")]
    if a.source.lower().startswith(REMOTE_SCHEMES):
        return [Problem(path, f"{a.source!r}: adapters from a hub or a URL are not downloaded by llmgw yet: put the "
                              "adapter on the nodes and name its path (or pkg:<package>/<file>); a vLLM profile also "
                              "loads a Hugging Face id written ORG/NAME itself")]
    out: dict[str, Problem] = {}
    for p in serving:
        reason = ENGINES[p.engine].adapter_source_refusal(a.source)
        if reason and p.engine not in out:
            out[p.engine] = Problem(path, f"{p.engine} (profile {p.name}) {reason}")
    return list(out.values())


def _adapter_problems(model: Model, a: Adapter, path: str) -> list[Problem]:
    serving, problems = _serving(model, a, path)
    problems += _source_problems(a, serving, f"{path}.source")
    for p in serving:
        assert p.lora is not None
        if a.rank > p.lora.max_lora_rank:
            problems.append(Problem(f"{path}.rank", f"rank {a.rank} is above max_lora_rank {p.lora.max_lora_rank} "
                                                    f"of profile {p.name} (raise it there, or serve a lower rank)"))
    most = sum(_most_replicas(p) for p in serving)
    if isinstance(a.replicas, int) and most and a.replicas > most:
        problems.append(Problem(f"{path}.replicas", f"{a.replicas} replicas wanted, but the profiles that serve it run "
                                                    f"at most {most}"))
    if a.scale != 1.0 and serving and not any(p.engine == "llamacpp" for p in serving):
        problems.append(Problem(f"{path}.scale", "only llama.cpp applies an adapter at a scale; the profiles that "
                                                 "serve it apply it as trained"))
    return problems


def _slot_problems(model: Model, path: str) -> list[Problem]:
    """Per profile: no more adapters pinned to every replica than one holds. Per model: the
    adapters' replica counts fit in the adapter slots the profiles give (replicas x max_loras)."""
    problems = []
    need = supply = 0
    for j, p in enumerate(model.profiles):
        if p.lora is None:
            continue
        served = model.adapters_for(p)
        pinned = [a.name for a in served if a.pinned]
        if len(pinned) > p.lora.max_loras:
            problems.append(Problem(f"{path}.profiles[{j}].lora.max_loras",
                                    f"{len(pinned)} adapters are held by every replica (replicas: all: "
                                    f"{', '.join(pinned)}), but a replica holds at most max_loras {p.lora.max_loras}"))
        supply += _most_replicas(p) * p.lora.max_loras
        need += len(pinned) * _most_replicas(p)
    need += sum(a.replicas for a in model.adapters if isinstance(a.replicas, int))
    if supply and need > supply:
        problems.append(Problem(f"{path}.adapters", f"the adapters want {need} adapter slots (each one's replicas; "
                                                    f"`all` takes one on every replica), the profiles give {supply} "
                                                    "(replicas x max_loras)"))
    return problems


def model_problems(model: Model, path: str) -> list[Problem]:
    """What is wrong with `model`'s adapters (at `path`, the model's place in the catalog)."""
    if not model.adapters:
        return []
    problems = []
    for k, a in enumerate(model.adapters):
        problems += _adapter_problems(model, a, f"{path}.adapters[{k}]")
    return problems + _slot_problems(model, path)


def _names(raw: Any, key: str = "name") -> list[tuple[str, str]]:
    """(name, path suffix) of a mapping's name and aliases that are non-empty strings."""
    if not isinstance(raw, dict):
        return []
    out = [(raw[key], ".name")] if isinstance(raw.get(key), str) and raw[key] else []
    aliases = raw.get("aliases")
    if isinstance(aliases, list):
        out += [(x, f".aliases[{i}]") for i, x in enumerate(aliases) if isinstance(x, str) and x]
    return out


def name_problems(raw_models: list[Any]) -> list[Problem]:
    """Adapter names and aliases unique across every model, alias and adapter of the catalog (a
    client's `model` must name exactly one thing)."""
    owner: dict[str, str] = {}
    for i, m in enumerate(raw_models):
        for name, _ in _names(m):
            owner.setdefault(name, f"models[{i}]")
    problems = []
    for i, m in enumerate(raw_models):
        adapters = m.get("adapters") if isinstance(m, dict) else None
        if not isinstance(adapters, list):
            continue
        for k, a in enumerate(adapters):
            apath = f"models[{i}].adapters[{k}]"
            own = a.get("name") if isinstance(a, dict) else None
            for name, suffix in _names(a):
                where = apath + suffix
                if suffix != ".name" and name == own:
                    problems.append(Problem(where, f"alias {name!r} is the adapter's own name"))
                elif name in owner and owner[name] == apath:
                    problems.append(Problem(where, f"{name!r} is listed twice"))
                elif name in owner:
                    problems.append(Problem(where, f"{name!r} is already the name or an alias of {owner[name]}"))
                else:
                    owner[name] = apath
    return problems
