"""Precise mode in the router: where an engine publishes KV events, what it reports holding decides
the prompt's match at that endpoint, over what the gateway predicted from what it sent."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from gateway.config import RoutingConfig
from gateway.routing.choice import COMPLETION, RouteRequest
from gateway.routing.load import EndpointStats
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


def word_tokens(endpoint, op, body) -> list[int]:
    """A tokenizer of one token per word: a prompt of short words is far fewer tokens than the
    gateway's estimate from its size (a quarter of its bytes), as a real tokenizer's count can differ."""
    return [sum(w.encode()) for m in body["messages"] for w in m["content"].split()]


def test_a_prompt_is_priced_at_the_engines_own_length_not_the_estimate_from_its_size():
    """The holder of most of a conversation is charged for the part it does not hold, counted in the
    engines' tokens: priced from the size estimate (here 4x the real length), the remainder was
    charged at several times its length, and a holder whose prefill rate was learned slower lost the
    next turn to a replica holding none of it (CI's vLLM run, tests/e2e/test_vllm_cpu.py)."""
    r = Router(RoutingConfig(prefill_ms_per_token=5.0), Clock(), random.Random(1), tokenize=word_tokens)
    r.apply_tables(tables_from(1, "fp", [ep("e0"), ep("e1")], CatalogOutline(), {}), True)
    body = {"model": "m", "messages": [{"role": "system", "content": "internationalization considerations documentation " * 40},
                                       {"role": "user", "content": "and now?"}]}
    toks = word_tokens(None, CHAT, body)
    held = (len(toks) - 10) // BS * BS  # e0 reported all but the last few words' blocks
    r.kv.apply("e0", Batch(0, 0.0, (BlocksStored(tuple(range(1, held // BS + 1)), None, tuple(toks[:held]), BS),)))
    r.kv.apply("e1", Batch(0, 0.0, ()))  # heard from, holding nothing of it
    req = request(body)
    assert req.prompt_tokens > 2 * len(toks)  # the estimate from the body's size
    # e0's engine showed a prefill rate 8x e1's (a long prompt's rate, on a busy core).
    r.snapshot = replace(r.snapshot, stats={"e0": EndpointStats(prefill=0.04), "e1": EndpointStats(prefill=0.005)})
    c = r.route(req)
    assert c.endpoint.id == "e0" and c.kv_events and c.matched == held
    assert c.prompt == len(toks)
    assert c.prefill == pytest.approx((len(toks) - held) * 0.04)
    # The answer names what came next, and what it was expected to cost.
    assert c.runner_up is not None and c.runner_up[0] == "e1" and c.runner_up[1] > c.score and c.runner_up[2] == 0
