"""What the gateway decides for a request before routing it, pure: `plan(call, tables, priority, tenant,
affinity, prefix_routing, asked, key_targets, cache_salt) -> Plan`, a frozen value beside the frozen Call.

A retry, a resumed answer and an evicted one keep the same Plan: they are the same request, served for
the same tenant, under the same key, charged once (gateway.http.attempt holds the charge).
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.request.call import Call, salted
from gateway.routing.adapters import AdapterRoute
from gateway.routing.choice import COMPLETION, FIRST_TOKEN
from gateway.routing.prefixkeys import opens_conversation, prefix_of
from gateway.routing.tables import Tables
from llmgw.slo import NO_TARGETS, Targets, resolve
from llmgw.state.keypolicy import Tenant, order_rank


@dataclass(frozen=True, slots=True)
class Plan:
    """How a request is routed and queued."""

    canon: str  # the canonical name of the model it asks for (an alias's, an adapter's name as listed)
    priority: str  # its criticality (gateway.keys.gate: the header, capped at its key's)
    tenant: Tenant | None = None  # whom it is served for in fair order (None: a retrieval, never queued)
    affinity: str | None = None  # X-Session-ID, else the body's `user`: keeps a session on one endpoint
    adapter: AdapterRoute | None = None  # the LoRA adapter it names
    objective: str = COMPLETION  # what routing minimises: its first token, or its completion
    prefix: tuple[int, ...] = ()  # the prompt's block keys (gateway.routing.prefixkeys)
    prompt_tokens: float = 0.0
    opens: bool = False  # it starts a conversation (gateway.routing.prefixkeys.opens_conversation)
    # Its latency targets (llmgw.slo): its headers', else its key's defaults, else its model's catalog `slo:`.
    targets: Targets = NO_TARGETS
    # What the engines order and cache it by (`EngineDriver.order_changes`): its class's place in their
    # order (keypolicy.order_rank, vLLM's `priority`) and its key's prefix-cache salt (None: shared).
    rank: int = 0
    cache_salt: str | None = None


def plan(call: Call, tables: Tables, priority: str, tenant: Tenant | None, affinity: str | None,
         prefix_routing: bool = True, asked: Targets = NO_TARGETS, key_targets: Targets | None = None,
         cache_salt: str | None = None) -> Plan:
    """The request's plan over the routing tables. `affinity`: the X-Session-ID header. Its objective: the catalog's `routing.objective` for
    the model, else its first token when it streams, else its completion. Its block keys are seeded
    with the model's canonical name, the adapter and the salt the engines will see (`cache_salt`: its
    key's, keypolicy.cache_salt_of, else the body's own); only read with `prefix_routing`. Its targets:
    what its headers `asked` (gateway.request.targets), else its key's defaults (`key_targets`), else
    its model's (the catalog's `slo:`, `Tables.slos`)."""
    model = call.model
    canon = tables.canonical.get(model, model)
    adapter = tables.adapters.get(model) if tables.adapters else None
    objective = tables.objectives.get(canon) or (FIRST_TOKEN if call.stream else COMPLETION)
    affinity = affinity or user_of(call.body)
    slos = tables.slos
    targets = asked if key_targets is None and not slos else resolve(asked, key_targets, slos.get(canon))
    order = {"targets": targets, "rank": order_rank(priority), "cache_salt": cache_salt}
    if not prefix_routing or call.body is None:
        return Plan(canon, priority, tenant, affinity, adapter, objective, **order)
    keys, tokens = prefix_of(salted(call.body, cache_salt), call.route.op, canon,
                             adapter.name if adapter is not None else "")
    # (read only with block keys: where a prompt's history goes, gateway.routing.choice._pick)
    opens = bool(keys) and opens_conversation(call.body, call.route.op)
    return Plan(canon, priority, tenant, affinity, adapter, objective, keys, tokens, opens, **order)


def user_of(body: dict | None) -> str | None:
    """The body's OpenAI `user`, which keeps a session on one endpoint (X-Session-ID wins)."""
    user = body.get("user") if body is not None else None
    return user if isinstance(user, str) and user else None
