"""The fit estimates `llmgw status`, `llmgw explain` and the console show beside each profile: what
`llmgw.weights.fit` says a replica needs per device, from the shape a node agent read of its
remote source (`Store.weights_facts`). Pure."""

from __future__ import annotations

from typing import Mapping

from llmgw.catalog import Catalog
from llmgw.engines import get_engine
from llmgw.state.weights import WeightsFacts
from llmgw.weights import fit
from llmgw.weights.errors import SourceInvalid
from llmgw.weights.meta import Shape
from llmgw.weights.sources import REMOTE, parse_source


def remote_sources(catalog: Catalog | None) -> dict[tuple[str, str], str]:
    """(model, profile) -> the remote source it loads, normalised."""
    out = {}
    for model, profile in catalog.profiles() if catalog else ():
        try:
            source = parse_source(model.source_for(profile))
        except SourceInvalid:
            continue
        if isinstance(source, REMOTE):
            out[(model.name, profile.name)] = str(source)
    return out


def fit_estimates(catalog: Catalog | None, facts: Mapping[str, WeightsFacts]) -> dict[tuple[str, str], str]:
    """(model, profile) -> "~18.3 GiB per GPU at tensor_parallel 1 (weights ..., KV cache ..., overhead ...)"."""
    out = {}
    for (m, p), source in remote_sources(catalog).items():
        f = facts.get(source)
        if f is None or not f.shape:
            continue
        profile = catalog.model(m).profile(p)
        shape = Shape.from_dict(f.shape)
        workload = get_engine(profile.engine).fit_workload(profile, shape)
        if workload is not None:
            out[(m, p)] = fit.estimate(shape, workload).describe()
    return out
