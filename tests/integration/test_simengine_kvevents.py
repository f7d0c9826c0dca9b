"""The sim engine's KV events on vLLM's wire, read by a subscriber written from vLLM's definitions
(vllm/distributed/kv_events.py: msgspec structs, the batch array-like, events tagged maps; ZMQ PUB
frames topic / 8-byte big-endian sequence / payload; the ROUTER replay)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import requests
import zmq

from simengine import tokens as tok
from simengine.prefix import chain, external
from harness.procs import ProcessSet, free_port, python, wait_until


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


@pytest.fixture
def procs(tmp_path):
    ps = ProcessSet(tmp_path / "logs")
    yield ps
    ps.stop_all()


def test_kv_events_match_the_cache_and_replay_fills_a_gap(procs):
    port, pub, replay_port = free_port(), free_port(), free_port()
    p = procs.start("sim", [python(), "-m", "simengine", "--port", str(port), "--served-model-name", "m",
                            "--step-ms", "2", "--kv-tokens", "256", "--kv-events-endpoint", f"tcp://*:{pub}",
                            "--kv-events-replay-endpoint", f"tcp://*:{replay_port}", "--kv-events-topic", "kv"])
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: requests.get(url + "/health", timeout=1).status_code == 200, 15, what=f"sim\n{p.log()}")
    ctx = zmq.Context.instance()
    # A DEALER, not vLLM example's REQ: a REQ socket takes only the first of the replayed messages.
    sub, rep = ctx.socket(zmq.SUB), ctx.socket(zmq.DEALER)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(f"tcp://127.0.0.1:{pub}")
        rep.connect(f"tcp://127.0.0.1:{replay_port}")
        system = {"role": "system", "content": "a shared system prompt " * 12}
        prompts = [[system, {"role": "user", "content": f"question {i} " * 8}] for i in range(6)]
        for messages in prompts:  # KV for about two conversations: the later ones evict the earlier
            r = requests.post(url + "/v1/chat/completions", json={"model": "m", "messages": messages, "max_tokens": 20},
                              timeout=10)
            assert r.status_code == 200
        live = {}
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)

        def drained():
            while sub.poll(100):
                topic, seq, payload = sub.recv_multipart()
                assert topic == b"kv" and len(seq) == 8
                live[int.from_bytes(seq, "big")] = payload
            return live and max(live) >= 0

        wait_until(drained, 10, what="KV events")
        rep.send_multipart((b"", (0).to_bytes(8, "big")))  # the ROUTER reads [identity, "", start]
        replayed = {}
        while True:
            assert rep.poll(5000), "the replay ended without its end marker"
            empty, seq, payload = rep.recv_multipart()
            assert empty == b""
            if not payload:
                assert int.from_bytes(seq, "big", signed=True) == -1
                break
            replayed[int.from_bytes(seq, "big")] = payload
    finally:
        sub.close(linger=0)
        rep.close(linger=0)
    assert sorted(replayed) == list(range(len(replayed)))  # from 0, no gap
    assert all(replayed[s] == live[s] for s in live)  # what was missed live is what replay gives
    encoder = msgspec.msgpack.Encoder()
    held: dict[int, int | None] = {}
    for s in sorted(replayed):
        batch = decoder.decode(replayed[s])
        assert encoder.encode(batch) == replayed[s]  # byte for byte what vLLM's encoder writes
        assert batch.data_parallel_rank == 0 and batch.ts > 0
        for e in batch.events:
            if isinstance(e, BlockStored):
                assert e.block_size == 16 and e.medium == "GPU" and len(e.token_ids) == 16 * len(e.block_hashes)
                assert e.parent_block_hash is None or e.parent_block_hash in held
                for h in e.block_hashes:
                    held[h] = e.parent_block_hash
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    held.pop(h)
    assert any(isinstance(e, BlockRemoved) for s in replayed for e in decoder.decode(replayed[s]).events)
    last = [external(h) for h in chain(tok.chat_tokens(prompts[-1]), 16, None)]
    assert set(last) <= set(held)  # the newest prompt's blocks are held, evicted ones are not
    first_only = set(external(h) for h in chain(tok.chat_tokens(prompts[0]), 16, None)) - set(last)
    assert not first_only & set(held)
    metrics = requests.get(url + "/metrics", timeout=5).text
    assert 'vllm:prefix_cache_hits_total{engine="0",model_name="m"}' in metrics


def test_bad_kv_events_config_is_refused_with_a_clear_line(procs):
    p = procs.start("sim", [python(), "-m", "simengine", "--port", str(free_port()),
                            "--kv-events-config", '{"enable_kv_cache_events": true, "bogus": 1}'])
    assert p.popen.wait(10) == 2
    assert "unknown key(s) bogus" in p.log()
    p = procs.start("sim2", [python(), "-m", "simengine", "--port", str(free_port()), "--metrics-style", "llamacpp",
                             "--kv-events-endpoint", "tcp://*:5999"])
    assert p.popen.wait(10) == 2
    assert "need --metrics-style vllm" in p.log()
