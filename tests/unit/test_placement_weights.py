"""Placement by the weights (docs/weights.md): a remote source waits for its headers to be read, then
nodes holding it come first, nodes without room are refused with the figure, a profile its GPU (or
CPU node) cannot fit stays Pending with the estimate and what would fit, unhealthy GPUs get nothing
and their replicas are replaced."""

from __future__ import annotations

import dataclasses

from llmgw.gpus import parse_gpu_spec
from llmgw.state.node_records import CachedWeights, GPUDevice, NodeInfo
from llmgw.state.weights import WeightsFacts
from tests.unit.control_support import Sim, catalog, model, ready_record
from workers.control.plan import CreateReplica, StopReplica, plan

HF = "hf://org/smol-gguf/*Q4_1.gguf"
GIB = 1024 ** 3
# SmolLM2-135M Q4_1 as llmgw.weights.meta reads its GGUF header.
SMOL = dict(weights_bytes=96_576_768, layers=30, heads=9, kv_heads=3, head_dim=64, kv_elems_per_token=11_520,
            hidden=576, ff=1536, vocab=49_152, context_length=8192, architecture="llama")
FACTS = WeightsFacts(HF, "llamacpp", size=100_000_000, shape=SMOL, node="a")


def smol(args=(), gpu=None, replicas=1, name="p") -> dict:
    p = {"name": name, "engine": "llamacpp", "replicas": replicas, "args": list(args)}
    if gpu:
        p["gpu"] = {"class": gpu}
    return model("smol", p) | {"source": HF}


def gnode(name, gpus="", memory_mb=16_000, room=None, holds=(), where="/w") -> NodeInfo:
    return NodeInfo(name=name, gpus=parse_gpu_spec(gpus), memory_mb=memory_mb, weights_room=room, weights_dir=where,
                    weights=tuple(CachedWeights(s, 100_000_000) for s in holds))


def created(actions) -> list[CreateReplica]:
    return [a for a in actions if isinstance(a, CreateReplica)]


def test_a_remote_source_waits_for_its_headers_then_is_placed():
    sim = Sim(catalog(smol()), {"a": gnode("a")})
    [c] = created(plan(sim.cat, sim.snapshot(), sim.now))
    assert c.placement is None and c.pending_reason == (
        f"waiting for a node agent to read the headers of {HF} (its size and the model's shape, for the disk "
        "and fit checks)")
    sim.weights[HF] = FACTS
    [c] = created(plan(sim.cat, sim.snapshot(), sim.now))
    assert c.placement.nodes == ("a",)


def test_unreadable_headers_place_without_the_checks():
    sim = Sim(catalog(smol()), {"a": gnode("a", room=0)})
    sim.weights[HF] = WeightsFacts(HF, "llamacpp", error="not_found: no repository org/smol-gguf")
    [c] = created(plan(sim.cat, sim.snapshot(), sim.now))
    assert c.placement.nodes == ("a",)  # its download says why it cannot be fetched


def test_nodes_that_hold_the_weights_come_first_then_nodes_with_room():
    nodes = {"a": gnode("a", room=10 * GIB), "b": gnode("b", room=10 * GIB, holds=[HF]), "c": gnode("c", room=1)}
    sim = Sim(catalog(smol(replicas=2)), nodes, weights={HF: FACTS})
    placed = [c.placement.nodes for c in created(plan(sim.cat, sim.snapshot(), sim.now))]
    assert placed == [("b",), ("a",)]  # spread, b first (it holds them); never c (no room)


def test_no_room_anywhere_is_pending_with_the_figure():
    sim = Sim(catalog(smol()), {"a": gnode("a", room=9 * 1024 ** 2, where="/var/lib/llmgw/weights")},
              weights={HF: FACTS})
    [c] = created(plan(sim.cat, sim.snapshot(), sim.now))
    assert c.placement is None and c.pending_reason == "needs 95.4 MiB, 9.0 MiB free under /var/lib/llmgw/weights"
    assert [r.why for r in c.refusals] == [c.pending_reason]


def test_room_is_shared_by_the_replicas_placed_in_one_pass():
    gpu = {"a": gnode("a", "l4:2", room=150_000_000)}
    cat = catalog(smol(gpu="l4"), model("other", {"name": "p", "engine": "llamacpp", "gpu": {"class": "l4"}})
                  | {"source": "hf://org/other/x.gguf"})
    other = dataclasses.replace(FACTS, source="hf://org/other/x.gguf")
    sim = Sim(cat, gpu, weights={HF: FACTS, other.source: other})
    placements = [c.placement for c in created(plan(sim.cat, sim.snapshot(), sim.now))]
    assert sum(p is not None for p in placements) == 1  # 150 MB of room holds one 100 MB download


def test_a_profile_too_large_for_its_gpu_is_pending_with_the_estimate_and_what_would_fit():
    sim = Sim(catalog(smol(args=["-c", "1048576"], gpu="fake")), {"a": gnode("a", "fake:1:8")}, weights={HF: FACTS})
    [c] = created(plan(sim.cat, sim.snapshot(), sim.now))
    assert c.placement is None
    assert c.pending_reason.startswith("needs ~23.0 GiB per GPU at tensor_parallel 1; a FAKE has 8 GiB; -c 262144 "
                                       "would fit"), c.pending_reason
    small = Sim(catalog(smol(args=["-c", "8192"], gpu="fake")), {"a": gnode("a", "fake:1:8")}, weights={HF: FACTS})
    assert created(plan(small.cat, small.snapshot(), small.now))[0].placement.nodes == ("a",)


def test_fit_on_a_cpu_node_is_against_its_memory():
    sim = Sim(catalog(smol(args=["-c", "1048576"])), {"a": gnode("a", memory_mb=8192), "b": gnode("b", memory_mb=65536)},
              weights={HF: FACTS})
    [c] = created(plan(sim.cat, sim.snapshot(), sim.now))
    assert c.placement.nodes == ("b",)
    sim.nodes.pop("b")
    [c] = created(plan(sim.cat, sim.snapshot(), sim.now))
    assert c.pending_reason.startswith("needs ~22.6 GiB of memory; this node has 8 GiB"), c.pending_reason


def test_a_gpu_of_unknown_memory_is_not_refused():
    sim = Sim(catalog(smol(args=["-c", "1048576"], gpu="fake")), {"a": gnode("a", "fake:1")}, weights={HF: FACTS})
    assert created(plan(sim.cat, sim.snapshot(), sim.now))[0].placement.nodes == ("a",)


def sick(n: NodeInfo, index: int, why: str) -> NodeInfo:
    return dataclasses.replace(n, gpus=tuple(dataclasses.replace(g, healthy=False, health=why) if g.index == index
                                             else g for g in n.gpus))


def test_unhealthy_gpus_get_nothing_and_their_replicas_are_replaced():
    gpu = {"name": "g", "engine": "vllm", "gpu": {"class": "l4"}, "tensor_parallel": 1}
    cat = catalog(model("m", gpu))
    a = sick(gnode("a", "l4:2"), 0, "3 uncorrectable ECC errors since the GPU's last reset")
    sim = Sim(cat, {"a": a})
    [c] = created(plan(sim.cat, sim.snapshot(), sim.now))
    assert c.placement.gpus == (("a", (1,)),)  # GPU 0 is never free
    from llmgw.catalog import profile_spec_hash

    h = profile_spec_hash(cat.model("m"), cat.model("m").profile("g"))
    sim.records["r0"] = ready_record("r0", "m", "g", "a", sim.now, spec_hash=h, gpus={"a": [0]})
    acts = plan(sim.cat, sim.snapshot(), sim.now)
    [new] = created(acts)
    assert new.placement.gpus == (("a", (1,)),) and "GPU 0 on a is unhealthy: 3 uncorrectable ECC" in new.why
    sim.records["r1"] = ready_record("r1", "m", "g", "a", sim.now, spec_hash=h, gpus={"a": [1]})
    stops = [x for x in plan(sim.cat, sim.snapshot(), sim.now) if isinstance(x, StopReplica)]
    assert [s.id for s in stops] == ["r0"]  # replaced once the new one is Ready
    both = sick(a, 1, "NVML cannot reach the GPU")
    sim2 = Sim(cat, {"a": both})
    [p] = created(plan(sim2.cat, sim2.snapshot(), sim2.now))
    assert p.placement is None and "GPU 0 is unhealthy: 3 uncorrectable ECC" in p.refusals[0].why
    assert GPUDevice(0, "l4").healthy  # the default: healthy
