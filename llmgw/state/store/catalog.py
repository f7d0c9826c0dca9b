"""The applied catalog's documents: versioned, hashed, replaced atomically by compare-and-set.

`keys.CATALOG` holds the current document {"version", "hash", "spec", "applied_at", "applied_by",
"source"}; `keys.CATALOG_HISTORY` keeps the last HISTORY_LIMIT documents, newest first. Versions only
grow; storing content whose hash equals the applied one writes nothing. Here the spec is plain JSON:
`llmgw.catalog.store` turns it into a `Catalog` and back. What is read without validating the spec
(the outline, key variables, history) is read here, tolerant of a malformed document. The catalog
file watch's memory (`keys.CATALOG_FILE_STATE`) lives here too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

from llmgw.errors import CatalogConflict
from llmgw.state import keys
from llmgw.state.store.base import Aggregate, Pipeline
from llmgw.state.store.events import queue_event

HISTORY_LIMIT = 50


@dataclass(frozen=True)
class CatalogOutline:
    """What the gateway reads of the applied catalog: `canonical` maps every name and alias to its
    model's name; `groups` holds each model's names (its name, then its aliases), which a key's
    `--models` may list; `cold_start` maps the names of models that can scale to zero (a profile with
    `autoscale.min: 0`) to how long a request waits for a cold start (the longest such timeout)."""

    canonical: dict[str, str] = field(default_factory=dict)
    groups: list[tuple[str, ...]] = field(default_factory=list)
    cold_start: dict[str, float] = field(default_factory=dict)
    # LoRA adapters by name: {"model", "names" (name, then aliases), "scale", "replicas" (a count or
    # "all"), "profiles" (of its model, that serve it), "wait" (seconds a request waits for it to be
    # loaded)}. An adapter's names are in `canonical` (mapped to the adapter's name) and `groups` too.
    adapters: dict[str, dict] = field(default_factory=dict)


def meta(doc: Mapping[str, Any]) -> dict:
    """A stored document without its spec."""
    return {k: v for k, v in doc.items() if k != "spec"}


def queue_document(pipe: Pipeline) -> None:
    pipe.get(keys.CATALOG)


def take_document(replies: Iterator) -> str | None:
    return next(replies) or None


# How long a request for an adapter no replica holds waits for one to load it: a runtime load takes
# seconds; llama.cpp relaunches a replica with it (its start_timeout); a model scaled to zero starts first.
ADAPTER_LOAD_WAIT = 60.0
_AT_LAUNCH = ("llamacpp",)  # llmgw.catalog.types.ADAPTERS_AT_LAUNCH (the store reads no catalog types)


def _adapter_outline(m: dict, cold_start: float | None) -> dict[str, dict]:
    """A stored model's adapters, as the gateway reads them (see CatalogOutline.adapters)."""
    lora = {p["name"]: p for p in m.get("profiles") or [] if isinstance(p, dict) and p.get("lora")}
    out = {}
    for a in m.get("adapters") or []:
        if not isinstance(a, dict) or not isinstance(a.get("name"), str) or not a["name"]:
            continue
        profiles = [n for n in (a.get("profiles") or list(lora)) if n in lora]
        waits = [float(lora[n].get("start_timeout") or ADAPTER_LOAD_WAIT) if lora[n].get("engine") in _AT_LAUNCH
                 else ADAPTER_LOAD_WAIT for n in profiles] + ([cold_start] if cold_start else [])
        out[a["name"]] = {"model": m["name"],
                          "names": [a["name"], *(x for x in (a.get("aliases") or []) if isinstance(x, str) and x)],
                          "scale": float(a.get("scale", 1.0)), "replicas": a.get("replicas", 1),
                          "profiles": profiles, "wait": max(waits, default=ADAPTER_LOAD_WAIT)}
    return out


class Catalogs(Aggregate):
    def catalog_document(self) -> str | None:
        """The applied document as stored (JSON), None when none was ever applied."""
        return self.r.get(keys.CATALOG) or None

    def catalog_applied(self) -> bool:
        """Whether any catalog was ever applied to this Redis (one EXISTS)."""
        return bool(self.r.exists(keys.CATALOG))

    def catalog_stamp(self) -> tuple[int, str] | None:
        """(version, hash) of the applied document without validating its spec; None when none was
        ever applied. Raises ValueError when the document is not JSON."""
        raw = self.catalog_document()
        if raw is None:
            return None
        doc = json.loads(raw)
        return doc.get("version"), doc.get("hash")

    def catalog_version(self) -> int:
        """The applied version (0 when none), without validating the spec."""
        raw = self.catalog_document()
        return int(json.loads(raw)["version"]) if raw else 0

    def catalog_outline(self) -> CatalogOutline:
        """The applied catalog's names and cold-start timeouts in one GET, without validating the spec
        (the stored spec is resolved: every profile carries its full autoscale block)."""
        out = CatalogOutline()
        try:
            for m in _models(self.catalog_document()):
                if not isinstance(m, dict) or not isinstance(m.get("name"), str) or not m["name"]:
                    continue
                names = [m["name"], *(a for a in (m.get("aliases") or []) if isinstance(a, str) and a)]
                out.groups.append(tuple(names))
                waits = [float(a.get("cold_start_timeout") or 0) for p in m.get("profiles") or []
                         if isinstance(p, dict) and isinstance(a := p.get("autoscale"), dict) and a.get("min") == 0]
                for n in names:
                    out.canonical[n] = m["name"]
                    if waits:
                        out.cold_start[n] = max(waits)
                for name, entry in _adapter_outline(m, max(waits) if waits else None).items():
                    out.adapters[name] = entry
                    out.groups.append(tuple(entry["names"]))
                    out.canonical.update({n: name for n in entry["names"]})
        except (ValueError, AttributeError, TypeError):
            pass  # a malformed document names nothing; reading it as a Catalog reports it
        return out

    def catalog_names(self) -> set[str]:
        """Every model name and alias of the applied catalog (empty when none), without validating the
        spec: cheap enough for the gateway to call on each endpoint-list reload."""
        return set(self.catalog_outline().canonical)

    def key_variables(self) -> list[tuple[str, str, str]]:
        """(model, profile, variable) for every external profile of the applied catalog that names an
        `api_key_env`, without validating the spec (a gateway reads it on endpoint-list reloads, to warn
        about variables missing from its environment before the server is even reachable)."""
        out = []
        try:
            for m in _models(self.catalog_document()):
                for p in m.get("profiles") or []:
                    var = p.get("api_key_env")
                    if p.get("engine") == "external" and isinstance(var, str) and var:
                        out.append((str(m.get("name")), str(p.get("name")), var))
        except (ValueError, AttributeError, TypeError):
            pass  # a malformed document names nothing; reading it as a Catalog reports it
        return out

    def catalog_history(self, n: int = 10) -> list[dict]:
        """Metadata of the last `n` applied versions, newest first: version, hash, applied_at/by, source,
        plus `models` and `replicas` counts."""
        out = []
        for raw in self.r.lrange(keys.CATALOG_HISTORY, 0, max(0, n - 1)) if n > 0 else []:
            doc = json.loads(raw)
            models = (doc.get("spec") or {}).get("models", [])
            out.append({**meta(doc), "models": len(models),
                        "replicas": sum(p.get("replicas", 0) for m in models for p in m.get("profiles", []))})
        return out

    def catalog_history_document(self, version: int) -> dict | None:
        """A past version's document, while the history still keeps it (the last HISTORY_LIMIT)."""
        for raw in self.r.lrange(keys.CATALOG_HISTORY, 0, -1):
            doc = json.loads(raw)
            if int(doc["version"]) == version:
                return doc
        return None

    def store_catalog(self, digest: str, spec: dict, *, source: str, applied_by: str,
                      expected_version: int | None, now: float) -> tuple[int, bool]:
        """Store `spec` (hashed `digest`) as the next version, with its `catalog_applied` event. Returns
        (version, changed). Content whose hash equals the applied one changes nothing, even if another
        version was applied since `expected_version`; otherwise, with `expected_version`, raises
        CatalogConflict (writing nothing) if the applied version is no longer that one. The read, check
        and write are one WATCH/MULTI transaction; a new version is then confirmed on the replicas that
        `durability` asks for (`durably`: NotReplicated, carrying (version, True), when they fall short)."""

        def txn(pipe: Pipeline) -> tuple[int, bool]:
            raw = pipe.get(keys.CATALOG)
            current = json.loads(raw) if raw else {"version": 0, "hash": None}
            if current.get("hash") == digest:
                pipe.multi()
                return int(current["version"]), False
            if expected_version is not None and int(current["version"]) != expected_version:
                raise CatalogConflict(expected_version, int(current["version"]))
            version = int(current["version"]) + 1
            doc = {"version": version, "hash": digest, "spec": spec, "applied_at": now,
                   "applied_by": applied_by, "source": source}
            blob = json.dumps(doc, sort_keys=True)
            pipe.multi()
            pipe.set(keys.CATALOG, blob)
            pipe.lpush(keys.CATALOG_HISTORY, blob)
            pipe.ltrim(keys.CATALOG_HISTORY, 0, HISTORY_LIMIT - 1)
            queue_event(pipe, "catalog_applied", f"version {version} by {applied_by} from {source}",
                        source=applied_by, ts=now, version=version, hash=digest)
            return version, True

        return self.durably("the catalog version", lambda r: r.transaction(txn, keys.CATALOG, value_from_callable=True),
                            wrote=lambda out: out[1])

    def catalog_file_state(self) -> dict[str, str]:
        """What the catalog file watch last saw (path, stamp, sha, version, problems), as stored."""
        return self.r.hgetall(keys.CATALOG_FILE_STATE)

    def remember_catalog_file(self, **fields: str | int) -> None:
        self.r.hset(keys.CATALOG_FILE_STATE, mapping=fields)


def _models(raw: str | None) -> list:
    return (json.loads(raw).get("spec") or {}).get("models") or [] if raw else []
