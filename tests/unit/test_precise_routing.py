"""Precise mode in the router: where an engine publishes KV events, what it reports holding decides
the prompt's match at that endpoint, over what the gateway predicted from what it sent."""

from __future__ import annotations

import random

from gateway.config import RoutingConfig
from gateway.routing.choice import COMPLETION, RouteRequest
from gateway.routing.prefixkeys import prefix_of
from gateway.routing.router import Router
from gateway.routing.tables import tables_from
from gateway.server.tokenizers import Tokenizers
from llmgw.state.store.catalog import CatalogOutline
from llmgw.engines.kvwire import Batch, BlocksStored
from llmgw.surface import CHAT
from llmgw.state.clock import Clock
from llmgw.state.records import EndpointInfo
from simengine import tokens
from simengine.prefix import chain, external

BS = 16
BODY = {"model": "m", "messages": [{"role": "system", "content": "Billing desk rules, politely. " * 40},
                                   {"role": "user", "content": "my invoice?"}]}


def ep(i: str) -> EndpointInfo:
    return EndpointInfo(id=i, url=f"http://e/{i}", models=("m",), engine="sim", capacity=8, model="m",
                        kv_events=f"tcp://e:{i}", kv_replay=f"tcp://e:r{i}")


def router() -> Router:
    # A prefill slow enough that a hit outweighs any tie-break between otherwise equal endpoints.
    r = Router(RoutingConfig(prefill_ms_per_token=5.0), Clock(), random.Random(1), tokenize=Tokenizers({}).tokenize)
    r.apply_tables(tables_from(1, "fp", [ep("e0"), ep("e1")], CatalogOutline(), {}), True)
    return r


def engine_holds(r: Router, eid: str, body: dict) -> None:
    """The engine `eid` reports (one KV event batch) that it cached the prompt's full blocks."""
    toks = tokens.chat_tokens(body["messages"])
    hashes = [external(h) for h in chain(toks, BS, None)]
    r.kv.apply(eid, Batch(0, 0.0, (BlocksStored(tuple(hashes), None, tuple(toks[:len(hashes) * BS]), BS),)))


def request(body: dict) -> RouteRequest:
    keys, n = prefix_of(body, CHAT, "m")
    return RouteRequest("m", prefix=keys, prompt_tokens=n, objective=COMPLETION, body=body)


def test_the_engines_report_wins_over_what_was_sent():
    r = router()
    r.counts.prefixes.sent("e0", request(BODY).prefix)  # predicted: e0 holds it (it was sent there)
    engine_holds(r, "e0", {"messages": [{"role": "user", "content": "something else " * 10}]})  # e0 says: no
    engine_holds(r, "e1", BODY)  # e1 says it holds it (another gateway sent it there)
    c = r.route(request(BODY))
    assert c.endpoint.id == "e1" and c.kv_events and c.matched > 250


def test_without_the_body_or_before_any_event_the_prediction_stands():
    r = router()
    r.counts.prefixes.sent("e0", request(BODY).prefix)
    c = r.route(request(BODY))
    assert c.endpoint.id == "e0" and not c.kv_events  # nothing heard from the engines yet
    keys, n = prefix_of(BODY, CHAT, "m")
    engine_holds(r, "e1", BODY)
    c = r.route(RouteRequest("m", prefix=keys, prompt_tokens=n, objective=COMPLETION))  # no body: no lookup
    assert not c.kv_events
