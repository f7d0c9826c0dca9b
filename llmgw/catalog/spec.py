"""Which catalog changes roll a profile's replicas: the launch fields and the hash over them."""

from __future__ import annotations

import hashlib
import json

from llmgw.catalog.types import ADAPTERS_AT_LAUNCH, EXTERNAL_FIELDS, Model, Profile

# Profile fields that shape the launched process: a change of any of them rolls the replicas; every
# other field is read live by the router, the planner or the agent.
LAUNCH_FIELDS = frozenset({"engine", "gpu", "tensor_parallel", "pipeline_parallel", "nodes", "args", "env", "capacity",
                           "lora", "device", "threads", "cache_ram"})
# Launch fields only when set: a profile without them hashes as it did before they existed. A CPU
# replica of vLLM also gets its KV cache's size from `kv_cache_tokens` (VLLM_CPU_KVCACHE_SPACE).
_WHEN_SET = ("lora", "device", "threads", "cache_ram")


def profile_spec_hash(model: Model, profile: Profile) -> str:
    """Hash of what shapes the launched process, so a change of it (and only that) rolls the replicas.

    Covered: engine, source (the profile's own or the model's), gpu, tensor/pipeline parallelism,
    nodes, args, env, capacity (it becomes -np / --max-num-seqs), `lora` (flags), `device`, `threads`, `cache_ram`
    (and for `device: cpu`, `kv_cache_tokens`: vLLM's CPU KV space), the model's name and
    aliases (they become served names), and on an engine that loads adapters at launch
    (ADAPTERS_AT_LAUNCH) the name and source of each adapter the profile serves. Not covered, because the router, planner or agent read them live: replicas,
    autoscale, priority, scheduling_priority, weight, pool and node_selector (a node that no longer matches is handled as outdated by
    the planner), metrics, start_timeout and drain_timeout."""
    spec = profile.model_dump(
        mode="json",
        by_alias=True,
        # A profile without `lora` hashes as it did before profiles had one: nothing restarts.
        include=(set(LAUNCH_FIELDS) - {f for f in _WHEN_SET if getattr(profile, f) is None})
        | ({"kv_cache_tokens"} if profile.device == "cpu" else set()),
    )
    spec["_model"] = {"name": model.name, "aliases": model.aliases, "source": model.source_for(profile)}
    if profile.engine in ADAPTERS_AT_LAUNCH and model.adapters_for(profile):
        spec["_adapters"] = sorted([a.name, a.source] for a in model.adapters_for(profile))
    blob = json.dumps(spec, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def legacy_spec_hash(model: Model, profile: Profile) -> str:
    """The spec hash of records written before `profile_spec_hash` left out routing-only fields
    (metrics, start_timeout, pool, node_selector). Such a record is current while its profile is
    unchanged, so upgrading llmgw does not restart the fleet."""
    # Fields added since (an external profile's) were not in that hash: leaving them out keeps it.
    spec = profile.model_dump(mode="json", by_alias=True, exclude={"replicas", "priority", "weight", *EXTERNAL_FIELDS})
    spec["_model"] = {"name": model.name, "aliases": model.aliases, "source": model.source_for(profile)}
    blob = json.dumps(spec, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:12]
