"""`kv_events: true`: which engines take it, the flag it puts on the engine's command line (ports its
agent chose), what the agent records and what the endpoint list tells the gateways."""

from __future__ import annotations

import dataclasses
import json

import pytest

from llmgw.catalog import Model, Profile
from llmgw.engines import get_engine, tokenize_prompt
from llmgw.engines.base import KV_EVENTS_FLAG, LaunchContext
from llmgw.errors import CatalogInvalid
from tests.unit.control_support import catalog, cpu_profile, gpu_profile, model, ready_record
from workers.agent.supervisor.rules import starting
from workers.control.publish import endpoints_from

NOW = 1000.0


def test_vllm_and_the_sim_take_kv_events_and_llamacpp_is_refused_with_the_reason():
    catalog(model("m", gpu_profile(kv_events=True), cpu_profile("s", kv_events=True)))
    with pytest.raises(CatalogInvalid) as exc:
        catalog(model("m", {"name": "c", "engine": "llamacpp", "kv_events": True}))
    assert "kv_events" in str(exc.value) and "publishes no KV cache events" in str(exc.value)


def test_the_flag_is_llmgws_when_kv_events_is_on_and_the_users_otherwise():
    with pytest.raises(CatalogInvalid) as exc:
        catalog(model("m", gpu_profile(kv_events=True, args=[KV_EVENTS_FLAG, '{"enable_kv_cache_events": true}'])))
    assert "is set by llmgw when `kv_events` is true" in str(exc.value)
    # Without kv_events, a user's own --kv-events-config (their own consumer) is passed as it is.
    catalog(model("m", gpu_profile(args=[KV_EVENTS_FLAG, '{"enable_kv_cache_events": true}'])))


@pytest.mark.parametrize("engine,gpu", [("vllm", {"class": "a100"}), ("sim", None)])
def test_the_engine_publishes_on_the_ports_its_agent_chose(engine, gpu):
    p = Profile(name="p", engine=engine, gpu=gpu, kv_events=True)
    m = Model(name="m", source="org/m", profiles=[p])
    ctx = LaunchContext("r1", m, p, "0.0.0.0", 8101, gpus=(0,) if gpu else (), kv_events_port=8102, kv_replay_port=8103)
    argv = list(get_engine(engine).command(ctx).argv)
    cfg = json.loads(argv[argv.index(KV_EVENTS_FLAG) + 1])
    assert cfg == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:8102",
                   "replay_endpoint": "tcp://*:8103", "topic": ""}
    # No ports chosen (an older agent), or the profile does not ask: no flag.
    plain = LaunchContext("r1", m, p, "0.0.0.0", 8101, gpus=(0,) if gpu else ())
    assert KV_EVENTS_FLAG not in get_engine(engine).command(plain).argv


def test_the_sim_engine_flags_parse_in_the_sim_itself():
    from simengine.cli import parser

    p = Profile(name="p", engine="sim", kv_events=True)
    m = Model(name="m", profiles=[p])
    argv = get_engine("sim").command(LaunchContext("r1", m, p, "127.0.0.1", 8101, kv_events_port=9, kv_replay_port=10)).argv
    args = parser().parse_args(list(argv[argv.index("-m") + 2:]))
    assert args.kv_events_config.endpoint == "tcp://*:9" and args.kv_events_config.enable_kv_cache_events


def test_the_agent_records_the_ports_and_clears_them_when_an_attempt_has_none():
    from workers.agent.supervisor.actions import Start

    rec = ready_record("r1", "m", "p", "n1", NOW)
    fields = starting(rec, Start("r1", 2, True), NOW, 8101, "http://n1:8101", None, True, kv_ports=(8102, 8103))
    assert (fields["kv_events_port"], fields["kv_replay_port"]) == (8102, 8103)
    rec2 = ready_record("r1", "m", "p", "n1", NOW, kv_events_port=8102, kv_replay_port=8103)
    fields = starting(rec2, Start("r1", 3, True), NOW, 8101, "http://n1:8101", None, True)
    assert (fields["kv_events_port"], fields["kv_replay_port"]) == (None, None)
    assert "kv_events_port" not in starting(rec, Start("r1", 2, True), NOW, 8101, "http://n1:8101", None, True)


def test_the_endpoint_list_says_where_to_subscribe():
    cat = catalog(model("m", cpu_profile("s", kv_events=True), cpu_profile("plain")))
    recs = [dataclasses.replace(ready_record("a", "m", "s", "n1", NOW, kv_events_port=8102, kv_replay_port=8103),
                                url="http://10.0.0.7:8101"),
            ready_record("b", "m", "plain", "n1", NOW)]
    from tests.unit.control_support import node

    eps = {e.id: e for e in endpoints_from(cat, recs, {"n1": node("n1")}, NOW)}
    assert (eps["a"].kv_events, eps["a"].kv_replay) == ("tcp://10.0.0.7:8102", "tcp://10.0.0.7:8103")
    assert (eps["b"].kv_events, eps["b"].kv_replay) == ("", "")


def test_the_sim_tokenizes_as_it_serves():
    from simengine import tokens

    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert tokenize_prompt("sim", "chat", {"messages": msgs}) == tokens.chat_tokens(msgs)
    assert tokenize_prompt("sim", "completions", {"prompt": "abc"}) == tokens.prompt_tokens("abc")
    assert tokenize_prompt("vllm", "chat", {"messages": msgs}) is None  # no tokenizer here: predicted instead
