"""A catalog as the YAML an operator would write: every field its value would take anyway left out.

The stored catalog is fully resolved (every default spelled out: `llmgw.catalog.validate`), which is
what the passes read but not what anyone wrote; `catalog show -o yaml` and the console print this form
instead. `compact_spec(catalog)` drops each field whose absence resolves to the same value (a type's default,
the engine's, one derived from another field: `gpu.count` from the parallelism, `replicas` from
`autoscale.min`), trying each removal against the types' own resolution, so the result resolves back to
exactly the catalog it came from (`Catalog.model_validate(compact_spec(c)) == c`) and applies again as
"unchanged". Structural only: nothing of this machine (sources, GPU class maps) is consulted.
"""

from __future__ import annotations

import yaml
from pydantic import BaseModel, ValidationError

from llmgw.catalog.types import Adapter, Catalog, Model, Profile

# Fields kept whatever their value: what identifies the thing, and what the others are resolved by.
_KEEP = {Profile: ("name", "engine"), Adapter: ("name", "source", "rank"), Model: ("name",)}


def compact_spec(catalog: Catalog) -> dict:
    """The catalog as a document without the fields that resolve to their value anyway."""
    return {"models": [_model(m) for m in catalog.models]}


class _Inline(list):
    """A list of plain values written inline (`aliases: [a, b]`)."""


class _InlineMap(dict):
    """A mapping of plain values written inline (`gpu: {class: h100}`)."""


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(_Inline, lambda d, v: d.represent_sequence("tag:yaml.org,2002:seq", v, flow_style=True))
_Dumper.add_representer(_InlineMap, lambda d, v: d.represent_mapping("tag:yaml.org,2002:map", v, flow_style=True))


def compact_yaml(catalog: Catalog) -> str:
    """`compact_spec` as YAML, fields in the order the types declare them; a field's short list or map of
    plain values inline, the way the examples are written."""
    return yaml.dump(_styled(compact_spec(catalog)), Dumper=_Dumper, sort_keys=False, default_flow_style=False,
                     width=120, allow_unicode=True)


def _plain(v) -> bool:
    return not isinstance(v, (dict, list))


def _styled(doc):
    if isinstance(doc, list):
        return [_styled(v) for v in doc]
    if not isinstance(doc, dict):
        return doc
    out = {}
    for k, v in doc.items():
        if isinstance(v, list) and v and all(_plain(x) for x in v):
            out[k] = _Inline(v)
        elif isinstance(v, dict) and v and all(_plain(x) for x in v.values()):
            out[k] = _InlineMap(v)
        else:
            out[k] = _styled(v)
    return out


def _model(m: Model) -> dict:
    header = m.model_copy(update={"profiles": [], "adapters": []})
    doc = _minimal(Model, header, header.model_dump(mode="json", by_alias=True, exclude={"profiles", "adapters"}))
    doc["profiles"] = [_minimal(Profile, p, p.model_dump(mode="json", by_alias=True)) for p in m.profiles]
    if m.adapters:
        doc["adapters"] = [_minimal(Adapter, a, a.model_dump(mode="json", by_alias=True)) for a in m.adapters]
    return doc


def _minimal(cls: type[BaseModel], value: BaseModel, doc: dict) -> dict:
    """`doc` (the dump of `value`) less every key whose removal still validates to `value`; inside a
    mapping that must stay, each of its keys the same way."""

    def same(candidate: dict) -> bool:
        try:
            return cls.model_validate(candidate) == value
        except ValidationError:
            return False

    for key in list(doc):
        if key in _KEEP.get(cls, ()):
            continue
        without = {k: v for k, v in doc.items() if k != key}
        if same(without):
            doc = without
        elif isinstance(doc[key], dict):
            for sub in list(doc[key]):
                inner = {k: v for k, v in doc[key].items() if k != sub}
                if same({**doc, key: inner}):
                    doc = {**doc, key: inner}
    return doc
