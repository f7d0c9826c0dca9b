"""What the request path reads, as immutable values swapped whole: `Tables` (the endpoint list and the
catalog's names, built by the pure `tables_from`) inside a `Snapshot` with the loads and the
per-endpoint stats. Readers take one reference and no lock; writers build a new value and replace it
(gateway.routing.router).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Protocol, Sequence

from gateway.response_ids import endpoint_ref
from gateway.routing.adapters import AdapterRoute, adapter_table
from gateway.routing.load import EndpointStats
from llmgw.slo import Targets
from llmgw.state.records import EndpointInfo, LoadRecord


class CatalogNames(Protocol):
    """What the tables take from the applied catalog (llmgw.catalog's outline)."""

    canonical: Mapping[str, str]  # name or alias -> its model's name
    groups: Sequence[tuple[str, ...]]  # each model's names
    cold_start: Mapping[str, float]  # names of models that scale to zero -> seconds a request waits
    # (Optional) LoRA adapters by name: llmgw.state.store.CatalogOutline.adapters.


@dataclass(frozen=True)
class Tables:
    """The endpoint list this process routes by, and every name it knows."""

    version: int = 0
    fingerprint: str = ""
    loaded: bool = False  # built from a list that was read (not the empty tables of a starting process)
    endpoints: tuple[EndpointInfo, ...] = ()  # what routing chooses from
    by_id: Mapping[str, EndpointInfo] = field(default_factory=dict)  # every listed one, those missing a key too
    by_ref: Mapping[bytes, EndpointInfo] = field(default_factory=dict)  # by the digest response ids carry
    api_keys: Mapping[str, str] = field(default_factory=dict)  # endpoint id -> the key sent to it
    # endpoint id -> the variable it needs and this process lacks: not routed to (503 when alone).
    missing_keys: Mapping[str, str] = field(default_factory=dict)
    # Name or alias -> every name of its model (catalog and list): a key's `--models` may list any.
    names: Mapping[str, frozenset[str]] = field(default_factory=dict)
    # Names in the applied catalog or the list: 503 (no Ready replica), not 404. A model removed
    # from the catalog becomes unknown again once its endpoints are unpublished.
    known_models: frozenset[str] = frozenset()
    canonical: Mapping[str, str] = field(default_factory=dict)  # alias or name -> canonical model name
    # Names of models that scale to zero -> how long a request waits for a cold start.
    cold_start: Mapping[str, float] = field(default_factory=dict)
    # LoRA adapters by name and alias -> which endpoints hold them (gateway.routing.adapters).
    adapters: Mapping[str, AdapterRoute] = field(default_factory=dict)
    # Canonical model -> the catalog's `routing.objective` for it (published on its endpoints).
    objectives: Mapping[str, str] = field(default_factory=dict)
    # Canonical model -> its requests' default latency targets (the catalog's `slo:`, published on its endpoints).
    slos: Mapping[str, Targets] = field(default_factory=dict)
    # Canonical models whose answers do not move to another replica when their engine breaks off.
    no_resume: frozenset[str] = frozenset()
    # Some endpoint publishes KV events: precise prefix matches are looked up (gateway.routing.precise).
    precise: bool = False

    def names_of(self, model: str) -> frozenset[str]:
        """Every name of the model called `model` (just that name when it is unknown)."""
        return self.names.get(model) or frozenset((model,))

    def models(self) -> dict[str, list[EndpointInfo]]:
        """Each name with a routable endpoint, and those endpoints."""
        out: dict[str, list[EndpointInfo]] = {}
        for e in self.endpoints:
            for m in e.models:
                out.setdefault(m, []).append(e)
        return out


@dataclass(frozen=True)
class Snapshot:
    tables: Tables
    loads: Mapping[str, LoadRecord]  # the last LoadRecord of each listed endpoint
    stats: Mapping[str, EndpointStats]  # what was learned of each


EMPTY = Snapshot(Tables(), {}, {})


def name_table(groups: Sequence[tuple[str, ...]], endpoints) -> dict[str, frozenset[str]]:
    """Name or alias -> all names of its model, from the catalog's models and the endpoints' lists."""
    out: dict[str, frozenset[str]] = {}
    for g in [frozenset(names) for names in groups] + [frozenset(e.models) for e in endpoints]:
        for n in g:
            out[n] = out.get(n, frozenset()) | g
    return out


def key_values(endpoints: Sequence[EndpointInfo], environ: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """The key each external endpoint gets from `environ` (its `api_key_env`), and the endpoints
    whose variable is not set there."""
    values, missing = {}, {}
    for e in endpoints:
        if e.api_key_env:
            value = environ.get(e.api_key_env)
            if value:
                values[e.id] = value
            else:
                missing[e.id] = e.api_key_env
    return values, missing


def tables_from(version: int, fingerprint: str, endpoints: Sequence[EndpointInfo], catalog: CatalogNames,
                environ: Mapping[str, str]) -> Tables:
    """The tables for an endpoint list read at `version`, the catalog's names, and this process's
    environment (external servers' keys)."""
    api_keys, missing = key_values(endpoints, environ)
    names = name_table(catalog.groups, endpoints)
    return Tables(
        version=version, fingerprint=fingerprint, loaded=True,
        endpoints=tuple(e for e in endpoints if e.id not in missing),
        by_id={e.id: e for e in endpoints},
        precise=any(e.kv_events for e in endpoints),
        by_ref={endpoint_ref(e.id): e for e in endpoints},
        api_keys=api_keys, missing_keys=missing, names=names, known_models=frozenset(names),
        canonical={**catalog.canonical, **{n: e.model or e.models[0] for e in endpoints for n in e.models}},
        cold_start=dict(catalog.cold_start),
        adapters=adapter_table(getattr(catalog, "adapters", None) or {}, endpoints, catalog.cold_start),
        objectives={e.model or e.models[0]: e.objective for e in endpoints if e.objective},
        slos={e.model or e.models[0]: t for e in endpoints if (t := e.slo_targets()) is not None},
        no_resume=frozenset(e.model or e.models[0] for e in endpoints if not e.resume),
    )
