"""What a profile's weights add to its placement request (docs/weights.md): pure, over the snapshot.

A remote source (hf://, https://) is placed once some node agent has read its size and shape
(`Snapshot.weights`); until then its replicas are Pending and say so. Then a node needs room for the
bytes unless it holds them (and is preferred when it does), and each GPU class (or CPU node) the
fit estimate says is too small is refused with the estimate's message and what would fit
(`llmgw.weights.fit.advise`). A source whose headers could not be read is placed without the checks:
its download then fails with the reason."""

from __future__ import annotations

import dataclasses

from llmgw.catalog import Model, Profile
from llmgw.engines import get_engine
from llmgw.gpus import gpu_memory_mb, normalize_gpu_class
from llmgw.state.records import ReplicaRecord
from llmgw.weights import fit
from llmgw.weights.errors import SourceInvalid
from llmgw.weights.meta import Shape
from llmgw.weights.sources import REMOTE, parse_source
from workers.control.placement import PlacementRequest
from workers.control.snapshot import Snapshot


def remote_source(model: Model, profile: Profile) -> str | None:
    try:
        source = parse_source(model.source_for(profile))
    except SourceInvalid:
        return None
    return str(source) if isinstance(source, REMOTE) else None


def weights_terms(req: PlacementRequest, model: Model, profile: Profile, snap: Snapshot) -> PlacementRequest:
    """`req` with the disk and fit terms of the profile's weights (unchanged for a local source)."""
    source = remote_source(model, profile)
    if source is None:
        return req
    facts = snap.weights.get(source)
    if facts is None:
        return dataclasses.replace(req, hold=f"waiting for a node agent to read the headers of {source} (its size "
                                             "and the model's shape, for the disk and fit checks)")
    too_small: list[tuple[int, str]] = []
    workload = None
    shape = Shape.from_dict(facts.shape) if facts.shape else None
    if shape is not None:
        workload = get_engine(profile.engine).fit_workload(profile, shape)
    if shape is not None and workload is not None:
        for mem in _memories(snap.nodes.values(), req):
            device = fit.gpu_device(req.gpu_class, mem) if req.gpu_class else fit.cpu_device(mem)
            result = fit.advise(shape, workload, device)
            if not result.ok:
                too_small.append((mem, result.message))
    return dataclasses.replace(req, weights=source, weights_size=facts.size or 0, too_small=tuple(too_small))


def _memories(nodes, req: PlacementRequest) -> set[int]:
    """The distinct device memories (MiB) of the pool's nodes: one GPU of the class, or a CPU node's."""
    out: set[int] = set()
    for info in nodes:
        if info.pool != req.pool:
            continue
        if req.gpu_class is None:
            if info.memory_mb:
                out.add(info.memory_mb)
            continue
        mems = [gpu_memory_mb(req.gpu_class, g.memory_mb) for g in info.gpus
                if normalize_gpu_class(g.gpu_class) == req.gpu_class]
        if mems and min(mems):
            out.add(min(mems))
    return out


def on_unhealthy_gpu(rec: ReplicaRecord, unhealthy: dict[str, dict[int, str]]) -> str | None:
    """Why a replica must move: a GPU it holds reads unhealthy (None: none does)."""
    if not unhealthy or not rec.gpus:
        return None
    for node, idxs in rec.gpus.items():
        sick = unhealthy.get(node)
        for i in idxs if sick else ():
            if i in sick:
                return f"GPU {i} on {node} is unhealthy: {sick[i]}"
    return None
