"""The agent loop (the shell around `decide`) driven with fakes: fakeredis, a fake process runner, a
fake prober and a fake clock. `runner.set_ready(id)`, `runner.crash(id, exit_code=1)`, `clock.advance(5)`.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field

import fakeredis
import pytest
import yaml

from llmgw.catalog import apply_catalog, parse_catalog
from llmgw.state.records import ReplicaRecord
from llmgw.state.replica_state import State, derive
from llmgw.state.store import Store
from tests.support.clock import FakeClock
from workers.agent import supervisor as sv
from workers.agent.config import AgentSettings
from workers.agent.loop import Agent
from workers.agent.probe import ProbeResult
from workers.agent.runner import Found, Seen

CATALOG = """
models:
  - name: m
    profiles:
      - name: p
        engine: sim
        start_timeout: 30
"""


@dataclass
class FakeProc:
    rid: str
    attempt: int
    pid: int
    port: int
    alive: bool = True
    ready: bool = False
    exit: sv.ExitFacts | None = None
    signals: list[int] = field(default_factory=list)


class FakeRunner:
    def __init__(self, clock: FakeClock):
        self.clock = clock
        self.procs: dict[str, FakeProc] = {}
        self.next_pid = 100
        self.spawned: list[tuple[str, int, tuple[str, ...]]] = []
        self.specs = {}
        self.saved: dict[str, dict] = {}
        self.exit_on_term = True

    # --- test controls ---
    def set_ready(self, rid: str) -> None:
        self.procs[rid].ready = True

    def crash(self, rid: str, exit_code: int = 1) -> None:
        p = self.procs[rid]
        p.alive, p.ready = False, False
        p.exit = sv.ExitFacts(exit_code, None, self.clock.time())

    # --- the seam ---
    def spawn(self, rid, attempt, spec):
        self.next_pid += 1
        port = int(spec.argv[spec.argv.index("--port") + 1])
        self.procs[rid] = FakeProc(rid, attempt, self.next_pid, port)
        self.spawned.append((rid, attempt, spec.argv))
        self.specs[rid] = spec
        return self.next_pid, self.next_pid * 10

    def observe(self, rid, attempt, pid, pid_start):
        p = self.procs.get(rid)
        if p is None or p.attempt != attempt:
            return Seen(False, None, pid, pid_start)
        return Seen(p.alive, p.exit, p.pid, p.pid * 10, p.pid + 1)

    def signal(self, rid, pid, pid_start, sig):
        p = self.procs.get(rid)
        if p is None or p.pid != pid or not p.alive:
            return
        p.signals.append(sig)
        if sig == signal.SIGKILL or self.exit_on_term:
            p.alive, p.ready = False, False
            p.exit = sv.ExitFacts(-sig, sig, self.clock.time())

    def discover(self):
        return {r: Found(r, p.attempt, p.pid, p.pid * 10, p.pid + 1, p.alive) for r, p in self.procs.items()}

    def known_dirs(self):
        return list(self.procs)

    def save_record(self, rid, record):
        self.saved[rid] = record

    def saved_record(self, rid):
        return self.saved.get(rid)

    def last_activity(self, rid):
        return self.clock.time()

    def remove(self, rid):
        self.procs.pop(rid, None)

    def log_tail(self, rid, max_bytes=4000):
        return f"log of {rid}"

    def log_path(self, rid):
        return f"/state/replicas/{rid}/engine.log"


class FakeProber:
    def __init__(self, runner: FakeRunner):
        self.runner = runner

    def health(self, url, timeout):
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        ok = any(p.alive and p.ready and p.port == port for p in self.runner.procs.values())
        return ProbeResult(ok, None if ok else "connection refused")

    def fetch(self, url, timeout, secret=None):
        self.secrets = getattr(self, "secrets", []) + [secret]
        return "vllm:num_requests_running 1\n"


def agent_settings(**kw) -> AgentSettings:
    """Agent settings for these tests: probe on every pass (`probe_interval=0`, which the environment
    may not set, so built without validation) and restart backoff 1, 2, 4 ... capped at 60 s."""
    return AgentSettings.model_construct(**{"backoff_base": 1, "backoff_cap": 60, "stop_grace": 10,
                                            "probe_interval": 0, **kw})


@pytest.fixture
def env():
    r = fakeredis.FakeRedis(decode_responses=True)
    apply_catalog(Store(r), parse_catalog(yaml.safe_load(CATALOG)), source="test", applied_by="test")
    clock = FakeClock()
    runner = FakeRunner(clock)
    settings = agent_settings(node_name="a", port_range=(30000, 30009))
    store = Store(r)

    def make_agent(bindable=lambda port: True):
        return Agent(settings, store, runner, FakeProber(runner), clock, bindable=bindable)

    return store, runner, clock, make_agent


def create(store, rid="r1", **kw):
    store.create_replica(ReplicaRecord(id=rid, model="m", profile="p", node="a", nodes=["a"], **kw))


def state(store, rid="r1", now=1000.0):
    return derive(store.get_replica(rid), True, now).state


def test_start_then_ready(env):
    store, runner, clock, make_agent = env
    agent = make_agent()
    create(store)
    agent.tick()
    rec = store.get_replica("r1")
    assert rec.attempt == 1 and rec.port == 30000 and rec.url == "http://127.0.0.1:30000"
    assert rec.pid == runner.procs["r1"].pid and rec.pid_start == rec.pid * 10
    assert state(store, now=clock.t) is State.STARTING
    clock.advance(1)
    runner.set_ready("r1")
    agent.tick()
    rec = store.get_replica("r1")
    assert rec.first_ready_at == clock.t and rec.last_probe_ok
    assert state(store, now=clock.t) is State.READY
    assert [t.replica_id for t in agent.targets] == ["r1"]


def test_crash_backoff_1_2_4_then_crashloop(env):
    store, runner, clock, make_agent = env
    agent = make_agent()
    create(store)
    agent.tick()
    expected_backoffs = [1, 2, 4, 8]
    for i, backoff in enumerate(expected_backoffs):
        runner.set_ready("r1")
        agent.tick()
        runner.crash("r1", exit_code=1)
        agent.tick()
        rec = store.get_replica("r1")
        assert rec.exit_code == 1 and rec.restarts == i + 1 and rec.log_tail == "log of r1"
        assert rec.next_restart_at == pytest.approx(clock.t + backoff)
        clock.advance(backoff - 0.5)
        agent.tick()
        assert store.get_replica("r1").attempt == i + 1, "restarted before its backoff"
        clock.advance(0.5)
        if i < 3:
            assert state(store, now=clock.t) is State.FAILED
        agent.tick()
        assert store.get_replica("r1").attempt == i + 2
    runner.crash("r1", exit_code=1)
    agent.tick()
    assert state(store, now=clock.t) is State.CRASHLOOP
    assert len(runner.spawned) == 5


def test_stop_requested_then_stopped(env):
    store, runner, clock, make_agent = env
    agent = make_agent()
    create(store)
    agent.tick()
    runner.exit_on_term = False  # an engine that ignores SIGTERM
    store.update_replica("r1", stop_requested_at=clock.t, stop_reason="scale down")
    agent.tick()
    assert runner.procs["r1"].signals == [signal.SIGTERM]
    assert state(store, now=clock.t) is State.STOPPING
    clock.advance(10)
    agent.tick()
    assert runner.procs["r1"].signals == [signal.SIGTERM, signal.SIGKILL]
    agent.tick()
    rec = store.get_replica("r1")
    assert rec.stopped_at == clock.t and rec.exit_signal == signal.SIGKILL
    assert state(store, now=clock.t) is State.STOPPED
    assert not rec.failure_times


def test_a_new_agent_adopts_instead_of_restarting(env):
    store, runner, clock, make_agent = env
    first = make_agent()
    create(store)
    first.tick()
    runner.set_ready("r1")
    first.tick()
    pid = store.get_replica("r1").pid
    clock.advance(300)  # the old agent is gone for a while; the engine keeps running
    second = make_agent()
    actions = second.tick()
    # (beside its own first probe of the engine, `Probed`)
    assert [a for a in actions if not isinstance(a, sv.Probed)] == [
        sv.Adopt("r1", pid, pid * 10, pid + 1, fields={"adopted_at": clock.t})]
    rec = store.get_replica("r1")
    assert rec.adopted_at == clock.t and rec.pid == pid and rec.attempt == 1 and rec.restarts == 0
    second.tick()
    assert len(runner.spawned) == 1 and state(store, now=clock.t) is State.READY


def test_an_engine_whose_record_was_deleted_is_stopped(env):
    store, runner, clock, make_agent = env
    agent = make_agent()
    create(store)
    agent.tick()
    store.delete_replica("r1")
    agent.tick()
    assert runner.procs["r1"].signals == [signal.SIGTERM] and not runner.procs["r1"].alive
    assert store.get_replica("r1") is None  # never resurrected


def test_ports_skip_records_and_bound_ports(env):
    store, runner, clock, make_agent = env
    agent = make_agent(bindable=lambda port: port != 30001)
    create(store, "r0", port=30000)  # holds 30000 already (e.g. its previous attempt)
    create(store, "r1")
    create(store, "r2")
    agent.tick()
    ports = {rid: store.get_replica(rid).port for rid in ("r0", "r1", "r2")}
    assert ports["r0"] == 30000  # keeps its own port
    assert sorted([ports["r1"], ports["r2"]]) == [30002, 30003]


def test_a_replica_whose_model_is_not_in_the_catalog_is_not_started(env):
    store, runner, clock, make_agent = env
    agent = make_agent()
    store.create_replica(ReplicaRecord(id="x", model="nope", profile="p", node="a", nodes=["a"]))
    create(store, "r1")
    agent.tick()
    assert [s[0] for s in runner.spawned] == ["r1"]
    assert store.get_replica("x").started_at is None


def test_a_failing_spawn_is_a_failed_attempt_not_a_dead_loop(env):
    store, runner, clock, make_agent = env
    agent = make_agent()

    def boom(*a):
        raise OSError("no such file")

    runner.spawn = boom
    create(store)
    agent.tick()
    rec = store.get_replica("r1")
    assert rec.failure_times == [clock.t] and "no such file" in rec.log_tail
    assert state(store, now=clock.t) is State.FAILED


def test_start_timeout_kills_and_counts_as_failure(env):
    store, runner, clock, make_agent = env
    agent = make_agent()
    create(store)
    agent.tick()
    clock.advance(31)
    agent.tick()  # SIGTERM: not healthy within 30 s
    agent.tick()  # its exit is recorded as a failure
    rec = store.get_replica("r1")
    assert rec.exit_signal == signal.SIGTERM and len(rec.failure_times) == 1
    assert "start timeout" in rec.log_tail


def test_heartbeat_reports_the_node(env):
    store, runner, clock, make_agent = env
    agent = make_agent()
    agent.heartbeat()
    info = store.live_nodes()["a"]
    assert info.name == "a" and info.cpu_cores >= 1 and info.agent_started_at == 1000.0


def test_scraper_writes_load_records(env):
    from workers.agent.scrape import Scraper

    store, runner, clock, make_agent = env
    agent = make_agent()
    create(store)
    agent.tick()
    runner.set_ready("r1")
    agent.tick()
    scraper = Scraper(store, agent.prober, lambda: agent.targets, agent.settings, clock)
    [load] = scraper.once()
    assert load.ok and load.replica_id == "r1"
    assert store.loads(["r1"])["r1"].ok

    class Failing:
        def fetch(self, url, timeout, secret=None):
            raise OSError("timed out")

    scraper.prober = Failing()
    [bad] = scraper.once()
    assert not bad.ok and bad.error == "timed out" and not store.loads(["r1"])["r1"].ok

    class Reporting:  # an engine whose /v1/models says its context length
        asked: list = []

        def fetch(self, url, timeout, secret=None):
            self.asked.append(url.rsplit("/", 2)[-1])
            return '{"data": [{"id": "m", "max_model_len": 4096}]}' if url.endswith("/v1/models") else \
                "vllm:num_requests_running 1\n"

    scraper.prober = Reporting()
    [load] = scraper.once()
    assert load.context_length is None  # the engine did not say before: asked again only later
    clock.advance(30)
    scraper.once()
    [load] = scraper.once()
    assert load.ok and load.context_length == 4096 and store.loads(["r1"])["r1"].context_length == 4096
    assert Reporting.asked.count("models") == 1  # once known, never asked again



def record_engine_commands(monkeypatch) -> list:
    """Replace the engine drivers with one that records each LaunchContext (a member part is
    headless: only rank 0 serves HTTP); returns the list it appends to."""
    from llmgw.engines.base import LaunchSpec

    contexts: list = []

    class Recording:
        def command(self, ctx):
            contexts.append(ctx)
            return LaunchSpec(argv=("engine", "--port", str(ctx.port)), serves_http=ctx.node_rank == 0)

    monkeypatch.setattr("workers.agent.launch.get_engine", lambda name: Recording())
    return contexts


def test_multi_node_member_part_starts_with_rank_and_master_addr(env, monkeypatch):
    """Node b runs rank 1 of a two-node replica headed by a; only the head writes agent fields."""
    from llmgw.state.node_records import NodeInfo

    store, runner, clock, make_agent = env
    contexts = record_engine_commands(monkeypatch)
    store.write_heartbeat(NodeInfo(name="a", address="10.0.0.1"), 60)
    # The head (a) runs attempt 1 with its rendezvous on port 30009: a member joins a running head only.
    store.create_replica(ReplicaRecord(id="mn", model="m", profile="p", node="a", nodes=["a", "b"],
                                       gpus={"a": [0, 1], "b": [2, 3]}, attempt=1, started_at=clock.t,
                                       pid=1, port=30000, master_port=30009))
    member = Agent(agent_settings(node_name="b", port_range=(30100, 30109)),
                   store, runner, FakeProber(runner), clock, bindable=lambda p: True)
    member.tick()
    [ctx] = contexts
    assert (ctx.node, ctx.node_rank, ctx.nnodes, ctx.master_addr, ctx.master_port, ctx.gpus) == \
        ("b", 1, 2, "10.0.0.1", 30009, (2, 3))
    rec = store.get_replica("mn")
    assert (rec.started_at, rec.pid, rec.attempt) == (1000.0, 1, 1), "a member part must not write the head's fields"
    clock.advance(600)  # a headless part has no health endpoint: no start timeout kills it
    member.tick()
    assert runner.procs["mn"].alive and len(runner.spawned) == 1
    # stop request reaches the member part too
    store.update_replica("mn", stop_requested_at=clock.t)
    member.tick()
    assert not runner.procs["mn"].alive
    member.tick()
    rec = store.get_replica("mn")
    assert rec.stopped_at is None  # the head reports its own stop, not the member's
    assert rec.stopped_nodes == ["b"]  # the member confirms its part


def test_a_wiped_redis_does_not_stop_every_engine_and_gets_its_records_back(env):
    store, runner, clock, make_agent = env
    agent = make_agent()
    create(store, gpus={"a": [1]}, spec_hash="h1")
    agent.tick()
    runner.set_ready("r1")
    clock.advance(1)
    agent.tick()
    before = store.get_replica("r1")
    assert before.first_ready_at and before.engine_pid
    store.r.flushall()  # records and catalog gone: a wiped or wrong Redis, not a deletion
    agent.tick()
    assert runner.procs["r1"].alive and runner.procs["r1"].signals == []
    # The record is back, as the attempt was started (placement, GPUs, spec), with its live process.
    back = store.get_replica("r1")
    assert (back.model, back.profile, back.node, back.gpus, back.spec_hash) == ("m", "p", "a", {"a": [1]}, "h1")
    assert (back.attempt, back.pid, back.port, back.url) == (before.attempt, before.pid, before.port, before.url)
    assert back.first_ready_at is None and back.adopted_at is None
    assert "r1" in {r.id for r in store.replicas_on("a")}
    # The next pass adopts it (no restart) and reports it Ready again once it answers.
    clock.advance(1)
    agent.tick()
    clock.advance(1)
    agent.tick()
    again = store.get_replica("r1")
    assert again.adopted_at and again.first_ready_at and again.attempt == before.attempt
    assert len(runner.spawned) == 1
    # With a catalog applied again, the record stands: the engine is not an orphan.
    apply_catalog(store, parse_catalog(yaml.safe_load(CATALOG)), source="t", applied_by="t")
    agent.tick()
    assert runner.procs["r1"].alive and runner.procs["r1"].signals == []


def test_an_engine_without_a_saved_record_is_left_alone_when_redis_has_no_catalog(env):
    store, runner, clock, make_agent = env
    agent = make_agent()
    create(store)
    agent.tick()
    runner.saved.clear()  # started by an agent that kept no copy
    store.r.flushall()
    agent.tick()
    assert runner.procs["r1"].alive and store.get_replica("r1") is None


def test_one_replica_that_cannot_be_observed_does_not_stop_the_pass(env):
    store, runner, clock, make_agent = env
    agent = make_agent()
    create(store, "bad", attempt=1, started_at=clock.t, pid=1)
    create(store, "good")
    real = runner.observe

    def observe(rid, *a):
        if rid == "bad":
            raise PermissionError("/proc says no")
        return real(rid, *a)

    runner.observe = observe
    agent.tick()
    assert [s[0] for s in runner.spawned] == ["good"]
    assert store.get_replica("bad").exited_at is None  # unknown is not a crash


def test_a_ready_replica_turns_unhealthy_only_after_3_failed_probes(env):
    store, runner, clock, make_agent = env
    agent = make_agent()
    create(store)
    agent.tick()
    runner.set_ready("r1")
    agent.tick()
    runner.procs["r1"].ready = False  # /health stops answering
    for _ in range(2):
        clock.advance(1)
        agent.tick()
        assert state(store, now=clock.t) is State.READY
    clock.advance(1)
    agent.tick()
    assert state(store, now=clock.t) is State.UNHEALTHY
    assert store.get_replica("r1").probe_error == "connection refused"
    runner.set_ready("r1")
    clock.advance(1)
    agent.tick()
    assert state(store, now=clock.t) is State.READY


def test_engines_on_a_gpu_node_see_only_their_gpus(env):
    from llmgw.gpus import parse_gpu_spec

    store, runner, clock, make_agent = env
    agent = make_agent()
    agent.launcher.gpus = parse_gpu_spec("l4:4")
    store.create_replica(ReplicaRecord(id="g", model="m", profile="p", node="a", nodes=["a"], gpus={"a": [2, 3]}))
    create(store, "cpu")
    agent.tick()
    assert runner.specs["g"].env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert runner.specs["cpu"].env["CUDA_VISIBLE_DEVICES"] == ""


def two_node_env(env, monkeypatch):
    """A head agent on a and a member agent on b, each with its own runner, sharing one Redis."""
    from llmgw.state.node_records import NodeInfo

    store, _runner, clock, _make = env
    contexts = record_engine_commands(monkeypatch)
    store.write_heartbeat(NodeInfo(name="a", address="10.0.0.1"), 600)
    store.create_replica(ReplicaRecord(id="mn", model="m", profile="p", node="a", nodes=["a", "b"],
                                       gpus={"a": [0], "b": [0]}))
    head_runner, member_runner = FakeRunner(clock), FakeRunner(clock)
    head = Agent(agent_settings(node_name="a", node_address="10.0.0.1", port_range=(30000, 30009)), store,
                 head_runner, FakeProber(head_runner), clock, bindable=lambda p: True)
    member = Agent(agent_settings(node_name="b", port_range=(30100, 30109)), store, member_runner,
                   FakeProber(member_runner), clock, bindable=lambda p: True)
    return store, clock, head, head_runner, member, member_runner, contexts


def test_multi_node_stop_is_stopped_only_when_every_node_confirmed(env, monkeypatch):
    """The head's own stop must not free the GPUs of a member whose part still runs."""
    store, clock, head, head_runner, member, member_runner, _ = two_node_env(env, monkeypatch)
    head.tick()
    member.tick()
    assert head_runner.procs["mn"].alive and member_runner.procs["mn"].alive
    member_runner.exit_on_term = False  # the member's part takes its time to stop
    store.update_replica("mn", stop_requested_at=clock.t, stop_reason="scale down")
    head.tick()
    head.tick()
    member.tick()
    rec = store.get_replica("mn")
    assert rec.stopped_at is not None and rec.stopped_nodes == ["a"]
    assert member_runner.procs["mn"].alive
    assert derive(rec, True, clock.t).state is State.STOPPING, "GPUs of b freed while its part runs"
    clock.advance(10)
    member.tick()  # grace over: SIGKILL
    member.tick()  # gone: confirmed
    rec = store.get_replica("mn")
    assert rec.stopped_nodes == ["a", "b"] and not member_runner.procs["mn"].alive
    assert derive(rec, True, clock.t).state is State.STOPPED
    # A member agent restarted now finds its confirmation in the record: nothing left to do.
    again = Agent(AgentSettings(node_name="b", port_range=(30100, 30109)), store, member_runner,
                  FakeProber(member_runner), clock, bindable=lambda p: True)
    assert again.tick() == []


def test_multi_node_member_rejoins_when_the_head_restarts(env, monkeypatch):
    store, clock, head, head_runner, member, member_runner, contexts = two_node_env(env, monkeypatch)
    member.tick()
    assert "mn" not in member_runner.procs, "a member part must wait for the head's attempt"
    head.tick()
    rec = store.get_replica("mn")
    assert rec.attempt == 1 and rec.master_port is not None and rec.master_port != rec.port
    member.tick()
    assert member_runner.spawned and contexts[-1].master_port == rec.master_port
    assert contexts[-1].master_addr == "10.0.0.1" and contexts[0].master_addr == "10.0.0.1"
    head_runner.set_ready("mn")
    head.tick()
    # The head crashes: the member's part is on a rendezvous that no longer exists.
    head_runner.crash("mn")
    head.tick()
    member.tick()
    assert member_runner.procs["mn"].signals == [signal.SIGTERM]
    member.tick()  # its exit is not a failure of its own, and it waits for the head's next attempt
    assert len(member_runner.spawned) == 1 and member.memory.members["mn"].get("failure_times", []) == []
    clock.advance(1)
    head.tick()  # head attempt 2
    assert store.get_replica("mn").attempt == 2
    member.tick()
    assert len(member_runner.spawned) == 2 and member_runner.procs["mn"].alive
    assert member.memory.members["mn"]["joined_attempt"] == 2


def test_probe_outcomes_come_from_the_supervisor(env, monkeypatch):
    """The loop applies what `supervisor.probed` decides (thresholds live there, not in the loop)."""
    store, runner, clock, make_agent = env
    agent = make_agent()
    create(store)
    agent.tick()
    calls = []
    real = sv.probes.probed

    def spy(*a, **kw):
        out = real(*a, **kw)
        calls.append(out)
        return out

    monkeypatch.setattr(sv.probes, "probed", spy)
    runner.set_ready("r1")
    clock.advance(1)
    agent.tick()
    assert calls and calls[-1].became_ready and store.get_replica("r1").first_ready_at == clock.t


def test_shutdown_waits_on_the_injected_clock(env, monkeypatch):
    """stop_engines escalates to SIGKILL after the grace period measured by the agent's clock; with a
    fake clock no real time passes."""
    import time as _time

    store, runner, clock, make_agent = env
    slept: list[float] = []

    def sleep(s):
        slept.append(s)
        clock.advance(s)

    def real_sleep(s):
        raise AssertionError(f"stop_engines slept {s}s of real time")

    agent = Agent(AgentSettings(node_name="a", port_range=(30000, 30009), stop_grace=10),
                  store, runner, FakeProber(runner), clock, bindable=lambda p: True, sleep=sleep)
    create(store)
    agent.tick()
    runner.exit_on_term = False
    t0 = clock.t
    with monkeypatch.context() as m:
        m.setattr(_time, "sleep", real_sleep)
        agent.stop_engines()
    assert runner.procs["r1"].signals == [signal.SIGTERM, signal.SIGKILL]
    # Only the injected sleep moved the fake clock, and the loop ended at the fake deadline: a deadline
    # on the real clock would have spun the injected sleep far past 10 fake seconds.
    assert slept and clock.t - t0 == pytest.approx(sum(slept))
    assert 10 <= clock.t - t0 <= 10 + max(slept)
    rec = store.get_replica("r1")
    assert rec.exit_signal == signal.SIGKILL and not rec.failure_times


def test_shutdown_is_given_what_it_needs_and_stops_what_the_state_dir_lists_when_redis_is_gone(env):
    """`stop_engines` takes a `Shutdown`, not the agent: with the records unreadable it still stops
    every attempt the state dir lists, and has no record to write of them."""
    from workers.agent.shutdown import Shutdown, stop_engines

    store, runner, clock, make_agent = env
    agent = make_agent()
    create(store)
    agent.tick()
    recorded: list[list] = []

    def unreadable(found, now):
        raise ConnectionError("Redis is gone")

    stop_engines(Shutdown("a", runner, unreadable, recorded.append, agent.policy, clock, clock.sleep))
    assert runner.procs["r1"].signals == [signal.SIGTERM] and not runner.procs["r1"].alive
    assert recorded == [[]]


def count_writes(store, monkeypatch) -> list[dict]:
    """Every record write the agent makes, one entry per round trip: {replica id: fields}."""
    calls: list[dict] = []
    real = store.update_replicas

    def update_replicas(updates):
        if any(updates.values()):
            calls.append({rid: dict(f) for rid, f in updates.items() if f})
        return real(updates)

    def update_replica(rid, **fields):
        raise AssertionError(f"the agent wrote {rid} outside its one write per pass")

    monkeypatch.setattr(store, "update_replicas", update_replicas)
    monkeypatch.setattr(store, "update_replica", update_replica)
    return calls


def test_each_record_is_written_once_per_pass(env, monkeypatch):
    """One pipelined write of the pass's facts; a started replica's shim pid is the one later write."""
    store, runner, clock, make_agent = env
    agent = make_agent()
    create(store, "r1")
    create(store, "r2")
    writes = count_writes(store, monkeypatch)
    agent.tick()  # both start: the intents, then the pids
    assert [sorted(w) for w in writes] == [["r1", "r2"], ["r1", "r2"]]
    assert set(writes[0]["r1"]) >= {"attempt", "started_at", "port", "url"} and set(writes[1]["r1"]) == {"pid",
                                                                                                        "pid_start"}
    writes.clear()
    clock.advance(1)
    runner.set_ready("r1")
    runner.crash("r2")
    agent.tick()  # r1's probe and engine pid, r2's exit (with its log): one write, one entry each
    [w] = writes
    assert sorted(w) == ["r1", "r2"]
    assert {"first_ready_at", "engine_pid"} <= set(w["r1"]) and {"exit_code", "log_tail"} <= set(w["r2"])


def test_a_launch_that_fails_is_news_and_kicks_a_reconcile(env, monkeypatch):
    from llmgw.state.kicks import RECONCILE

    store, runner, clock, make_agent = env
    kicks, emitted = [], []
    agent = Agent(agent_settings(node_name="a", port_range=(30000, 30009)), store, runner, FakeProber(runner), clock,
                  bindable=lambda port: True, kick=kicks.append)
    monkeypatch.setattr(store, "emit", lambda kind, message="", **f: emitted.append((kind, message)))

    def boom(*a):
        raise OSError("no such file")

    runner.spawn = boom
    create(store)
    agent.tick()
    assert [k for k, m in emitted if "could not start" in m] == ["replica_failed"]
    assert RECONCILE in kicks



def test_a_replica_with_nothing_to_write_is_not_taken_for_deleted(env, monkeypatch):
    """The adapter calls of a pass are made for every replica but those whose record the write found
    deleted. A replica whose facts this pass carry no field (a message only, say) is merged with
    nothing to write: it was not written, so it is not gone. (Taken for gone, its adapter unload was
    dropped while the keeper counted the call in flight forever: issue 28.)"""
    store, runner, clock, make_agent = env
    agent = make_agent()
    create(store, "r1")
    create(store, "r2")
    agent.tick()
    clock.advance(1)
    runner.set_ready("r1")
    runner.set_ready("r2")
    agent.tick()
    views = {r.id: r for r in store.all_replicas()}
    gones: list[set] = []
    monkeypatch.setattr(agent.adapters, "step", lambda _views, _now: [(views["r1"], sv.Facts(fields={})),
                                                                    (views["r2"], sv.Facts(fields={"adapters_held": []}))])
    monkeypatch.setattr(agent.adapters, "act", lambda gone: gones.append(set(gone)))
    store.delete_replica("r2")
    monkeypatch.setattr(sv, "decide", lambda *a, **k: [])  # no other fact this pass: r1 has nothing to write
    clock.advance(1)
    agent.tick()
    assert gones == [{"r2"}]


def test_an_engine_without_a_profile_is_read_by_its_engines_default_metric_names():
    # A replica whose model left the catalog (and the benchmarks' static fleets) has no profile: its
    # scrape still maps the engine's own names. It once built a stand-in profile whose name the
    # catalog's rules refuse, so every such scrape failed and the gateway routed without loads.
    from workers.agent.scrape import ScrapeTarget, scrape_one

    text = ("vllm:num_requests_running 3\nvllm:num_requests_waiting 1\nvllm:kv_cache_usage_perc 0.25\n"
            "vllm:prompt_tokens_total 4000\nvllm:prefix_cache_hits_total 1000\n"
            "vllm:request_prefill_time_seconds_sum 0.75\nvllm:request_prefill_kv_computed_tokens_sum 2500\n")
    for engine in ("vllm", "sim"):
        load = scrape_one(ScrapeTarget("r1", "http://e/metrics", engine, None), lambda *a, **k: text, 1.0, 5.0)
        assert load.ok, load.error
        assert (load.running, load.waiting, load.kv_usage) == (3, 1, 0.25)
        assert (load.prompt_tokens_total, load.prefix_hits_total, load.prefill_seconds_total) == (4000, 1000, 0.75)
        assert load.prefill_tokens_total == 2500  # counted with those seconds (gateway.routing.prefill)


def test_llamacpp_prompt_caches_share_the_node_s_memory_among_the_replicas_placed_there(tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setenv("LLMGW_LLAMA_SERVER", "/bin/true")
    r = fakeredis.FakeRedis(decode_responses=True)
    store = Store(r)
    apply_catalog(store, parse_catalog({"models": [{"name": "m", "source": str(gguf), "profiles": [
        {"name": "p", "engine": "llamacpp"}, {"name": "q", "engine": "llamacpp", "cache_ram": 1024}]}]}),
        source="test", applied_by="test")
    clock = FakeClock()
    runner = FakeRunner(clock)
    agent = Agent(agent_settings(node_name="a", port_range=(30000, 30009)), store, runner, FakeProber(runner), clock,
                  bindable=lambda port: True, node_memory_mb=16384)
    for rid, profile, node in (("l1", "p", "a"), ("l2", "p", "a"), ("l3", "q", "a"), ("other", "p", "b")):
        store.create_replica(ReplicaRecord(id=rid, model="m", profile=profile, node=node, nodes=[node]))
    store.create_replica(ReplicaRecord(id="going", model="m", profile="p", node="a", nodes=["a"],
                                       stop_requested_at=1.0))
    agent.tick()

    def cache(rid: str) -> str:
        argv = runner.specs[rid].argv
        return argv[argv.index("--cache-ram") + 1]

    # a quarter of 16 GiB, less what `q` fixes, split between the two replicas of `p` on this node; the
    # replica on another node and the one being stopped take none of it
    assert (cache("l1"), cache("l2"), cache("l3")) == ("1536", "1536", "1024")
