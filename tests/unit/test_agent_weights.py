"""The download phase of the node agent: the pure rules (`supervisor.weights`), the fetcher's one
download per source, pulls, the heartbeat's cache report and GPU health, with fakes."""

from __future__ import annotations

import threading

import pytest

from llmgw.state.node_records import GPUDevice
from llmgw.state.records import ReplicaRecord
from llmgw.state.replica_state import State, derive
from llmgw.weights.download import Local, Progress
from llmgw.weights.errors import DownloadFailed
from llmgw.weights.gpuhealth import Health, Reading
from harness.procs import wait_until
from workers.agent import supervisor as sv
from workers.agent.inventory import GpuHealth, health_changes
from workers.agent.weights import Fetcher, pull_step

P = sv.Policy(backoff_base=1, backoff_cap=60)
HF = "hf://org/smol-gguf/*Q4_1.gguf"


def rec(**kw) -> ReplicaRecord:
    return ReplicaRecord(**{**dict(id="r1", model="m", profile="p", node="a", nodes=["a"]), **kw})


def obs(fetch: sv.Fetch | None = None, **kw) -> sv.Observed:
    return sv.Observed(weights_source=HF, weights_layout="llamacpp", fetch=fetch, **kw)


def one(r: ReplicaRecord, o: sv.Observed, now: float = 100.0):
    return sv.decide([r], {r.id: o}, [], now, P, "a")


# --- the rules -----------------------------------------------------------------------------------------
def test_a_remote_source_is_fetched_before_the_engine_starts():
    [a] = one(rec(), obs())
    assert isinstance(a, sv.FetchWeights) and (a.source, a.layout) == (HF, "llamacpp")
    assert a.fields["weights_source"] == HF and a.fields["weights_phase"] == "queued"
    assert derive(rec(**a.fields), True, 100.0).state is State.DOWNLOADING


def test_a_local_source_starts_at_once():
    assert one(rec(), sv.Observed()) == [sv.Start("r1", 1, restart=False)]


def test_progress_is_recorded_once_a_pass_and_only_what_changed():
    r = rec(weights_source=HF, weights_phase="queued")
    f = sv.Fetch("downloading", done=30, total=100, rate=10.0, eta=7.0, file="m.gguf")
    [a] = one(r, obs(f))
    assert isinstance(a, sv.WeightsProgress) and a.milestone == 25
    assert a.fields == {"weights_phase": "downloading", "weights_done": 30, "weights_total": 100,
                        "weights_rate": 10.0, "weights_eta": 7.0, "weights_file": "m.gguf"}
    r2 = rec(**{**r.__dict__, **a.fields})
    assert one(r2, obs(f)) == []  # nothing new: nothing written
    [b] = one(r2, obs(sv.Fetch("downloading", done=80, total=100, rate=10.0, eta=2.0, file="m.gguf")))
    assert b.fields == {"weights_done": 80, "weights_eta": 2.0} and b.milestone == 75


@pytest.mark.parametrize("before,total,done,mark", [(0, 100, 24, None), (0, 100, 25, 25), (20, 100, 60, 50),
                                                    (60, 100, 70, None), (0, None, 50, None), (0, 0, 1, None)])
def test_milestones(before, total, done, mark):
    assert sv.weights.passed(before, total, done, total) == mark


def test_local_weights_start_the_engine_on_their_path_in_the_same_pass():
    r = rec(weights_source=HF, weights_phase="downloading", weights_done=99, weights_total=100)
    acts = one(r, obs(sv.Fetch("complete", 100, 100, path="/w/m.gguf", fetched=90, seconds=2.0)))
    local, cancel, start = acts
    assert isinstance(local, sv.WeightsLocal) and local.fields["weights_local_at"] == 100.0
    assert local.fields["weights_path"] == "/w/m.gguf" and cancel == sv.CancelFetch("r1")
    assert start == sv.Start("r1", 1, restart=False, weights_path="/w/m.gguf")


def test_once_local_a_restart_needs_no_download():
    r = rec(weights_source=HF, weights_phase="complete", weights_local_at=50, weights_path="/w/m.gguf", attempt=1,
            started_at=60, exited_at=90, exit_code=1, failure_times=[90.0], next_restart_at=91)
    assert one(r, obs()) == [sv.Start("r1", 2, restart=True, weights_path="/w/m.gguf")]


def test_a_failed_download_is_a_failure_with_backoff_and_its_reason():
    r = rec(weights_source=HF, weights_phase="downloading", failure_times=[95.0])
    failed, cancel = one(r, obs(sv.Fetch("failed", kind="auth", reason="the hub refused the token")))
    assert isinstance(failed, sv.WeightsFailed) and cancel == sv.CancelFetch("r1")
    assert failed.fields["failure_times"] == [95.0, 100.0] and failed.next_restart_at == 102.0
    after = rec(**{**r.__dict__, **failed.fields})
    view = derive(after, True, 100.0)
    assert view.state is State.FAILED and view.reason == "download failed (auth): the hub refused the token"
    assert one(after, obs(), now=101.0) == []  # backing off
    [again] = one(after, obs(), now=102.0)
    assert isinstance(again, sv.FetchWeights)


def test_a_stop_while_downloading_cancels_the_download():
    r = rec(weights_source=HF, weights_phase="downloading", stop_requested_at=99.0)
    acts = one(r, obs(sv.Fetch("downloading", 5, 10)))
    assert acts[0] == sv.CancelFetch("r1") and isinstance(acts[1], sv.MarkStopped)


def test_events_of_a_download():
    r = rec(weights_source=HF, weights_done=10 * 1024 ** 2)
    [started] = sv.news(r, sv.FetchWeights("r1", HF, "llamacpp"))
    assert started.kind == "weights_download_started" and "resuming from 10.0 MiB on disk" in started.message
    [failed] = sv.news(r, sv.WeightsFailed("r1", "not_found", "no repository org/x", 102.0))
    assert failed.kind == "weights_download_failed" and "not_found: no repository org/x" in failed.message
    [mark] = sv.news(r, sv.WeightsProgress("r1", 50, fields={"weights_total": 2 * 1024 ** 3}))
    assert mark.message == f"50% of 2.0 GiB ({HF})"
    [done] = sv.news(r, sv.WeightsLocal("r1", "/w/m", 100 * 1024 ** 2, 100 * 1024 ** 2, 2.0))
    assert done.kind == "weights_download_complete" and "(50.0 MiB/s)" in done.message


# --- the fetcher ---------------------------------------------------------------------------------------
class FakeDownloader:
    """Blocks each download until the test releases it; counts the downloads per source."""

    def __init__(self, root="/w"):
        from pathlib import Path

        self.root, self.budget, self.calls = Path(root), None, []
        self.go, self.fail = threading.Event(), None
        self.in_use = set

    def ensure(self, source, engine, on_progress, cancel):
        self.calls.append(source)
        on_progress(Progress(source, "downloading", 5, 10))
        while not self.go.wait(0.01):
            if cancel.is_set():
                raise DownloadFailed(source, "cancelled", "the download was cancelled")
        if self.fail:
            raise self.fail
        on_progress(Progress(source, "complete", 10, 10))
        return Local(source, "/w/m.gguf", 10, fetched=10)


def test_two_replicas_of_one_source_share_one_download():
    d = FakeDownloader()
    f = Fetcher(d, workers=2)
    try:
        f.want("r1", HF, "llamacpp")
        f.want("r2", HF, "llamacpp")
        wait_until(lambda: (v := f.view("r2")) and v.phase == "downloading", 5, what="progress")
        assert f.view("r1") == f.view("r2") == sv.Fetch("downloading", 5, 10)
        d.go.set()
        wait_until(lambda: f.view("r1").phase == "complete", 5, what="the download to complete")
        assert f.view("r2").path == "/w/m.gguf" and d.calls == [HF]
    finally:
        f.close()


def test_a_download_nobody_wants_is_cancelled_and_one_still_wanted_is_not():
    d = FakeDownloader()
    f = Fetcher(d, workers=1)
    try:
        f.want("r1", HF, "llamacpp")
        f.want("r2", HF, "llamacpp")
        wait_until(lambda: f.view("r1") and f.view("r1").phase == "downloading", 5, what="progress")
        job = f.jobs[HF]
        f.release("r1")
        assert not job.cancel.is_set() and f.view("r1") is None
        f.release("r2")
        assert job.cancel.is_set() and f.subscribers() == set()
        f.want("r3", HF, "llamacpp")  # wanted again: a new download (continuing from the partial on disk)
        assert f.jobs[HF] is not job
    finally:
        f.close()


def test_a_failed_download_is_not_joined_by_a_later_try():
    d = FakeDownloader()
    d.fail = DownloadFailed(HF, "not_found", "no such repository")
    d.go.set()
    f = Fetcher(d, workers=1)
    try:
        f.want("r1", HF, "llamacpp")
        wait_until(lambda: f.view("r1").phase == "failed", 5, what="the failure")
        assert (f.view("r1").kind, f.view("r1").reason) == ("not_found", "no such repository")
        d.fail = None
        f.want("r2", HF, "llamacpp")
        wait_until(lambda: f.view("r2").phase == "complete", 5, what="the new try")
        assert len(d.calls) == 2
    finally:
        f.close()


def test_pulls_are_subscribed_reported_and_finished():
    step = pull_step({HF: "llamacpp", "hf://o/b": "vllm"},
                     {HF: sv.Fetch("downloading", 5, 10, rate=1.0, eta=5.0), "hf://o/b": None}, 7.0)
    assert step.want == (("hf://o/b", "vllm"),)
    [(status, done)] = step.report
    assert (status.phase, status.done, status.total, status.at, done) == ("downloading", 5, 10, 7.0, False)
    [(failed, done)] = pull_step({HF: "llamacpp"}, {HF: sv.Fetch("failed", kind="auth", reason="401")}, 8.0).report
    assert done and (failed.error_kind, failed.error) == ("auth", "401")


# --- GPU health --------------------------------------------------------------------------------------
def test_gpu_health_marks_unhealthy_gpus_and_says_so_each_way():
    readings = [[Reading(0), Reading(1, ecc_uncorrected=3)]]
    events = []
    h = GpuHealth(lambda: readings[0], lambda kind, msg: events.append((kind, msg)))
    gpus = (GPUDevice(0, "l4", 24576), GPUDevice(1, "l4", 24576))
    out = h.step(gpus, 0.0)
    assert [g.healthy for g in out] == [True, False]
    assert out[1].health == "3 uncorrectable ECC errors since the GPU's last reset"
    assert events == [("gpu_unhealthy", "GPU 1 is unhealthy: 3 uncorrectable ECC errors since the GPU's last "
                                        "reset; its replicas are replaced elsewhere and it gets no new one")]
    h.step(gpus, 1.0)
    assert len(events) == 1  # no change, no event
    readings[0] = [Reading(0), Reading(1)]
    assert all(g.healthy for g in h.step(gpus, 2.0))
    assert events[-1] == ("gpu_healthy", "GPU 1 is healthy again: it gets replicas again")
    readings[0] = None  # nvidia-smi failed: the last verdict stands
    assert all(g.healthy for g in h.step(gpus, 3.0))


def test_health_changes():
    ok, bad = Health(0, True), Health(0, False, "lost")
    assert health_changes({}, {0: ok}) == [] and health_changes({}, {0: bad}) == [bad]
    assert health_changes({0: bad}, {0: bad}) == [] and health_changes({0: bad}, {0: ok}) == [ok]



# --- the loop ------------------------------------------------------------------------------------------
def test_the_loop_downloads_then_starts_the_engine_on_the_local_path_and_writes_once_a_pass():
    import fakeredis
    import yaml

    from llmgw.catalog import apply_catalog, parse_catalog
    from llmgw.state.store import Store
    from tests.support.clock import FakeClock
    from tests.unit.test_agent_loop import FakeProber, FakeRunner, agent_settings
    from workers.agent.loop import Agent
    from workers.agent.weights import NodeWeights, Pulls, Surveyor

    store = Store(fakeredis.FakeRedis(decode_responses=True))
    catalog = {"models": [{"name": "m", "source": HF, "profiles": [{"name": "p", "engine": "sim"}]}]}
    apply_catalog(store, parse_catalog(catalog), source="test", applied_by="test")
    clock, d = FakeClock(), FakeDownloader()
    runner = FakeRunner(clock)
    fetcher = Fetcher(d, workers=1)
    weights = NodeWeights(fetcher, Surveyor(d, store, "a"), Pulls(fetcher, store, "a"))
    agent = Agent(agent_settings(node_name="a", port_range=(30000, 30009)), store, runner, FakeProber(runner),
                  clock, bindable=lambda port: True, weights=weights)
    try:
        store.create_replica(ReplicaRecord(id="r1", model="m", profile="p", node="a", nodes=["a"]))
        agent.tick()
        r = store.get_replica("r1")
        assert (r.weights_source, r.weights_phase) == (HF, "queued") and not runner.spawned
        wait_until(lambda: fetcher.view("r1") and fetcher.view("r1").phase == "downloading", 5, what="progress")
        agent.tick()
        r = store.get_replica("r1")
        assert (r.weights_phase, r.weights_done, r.weights_total) == ("downloading", 5, 10)
        assert derive(r, True, clock.t).reason == "50% 0.0 of 0.0 MiB"
        d.go.set()
        wait_until(lambda: fetcher.view("r1").phase == "complete", 5, what="the download")
        clock.advance(1)
        agent.tick()
        r = store.get_replica("r1")
        assert r.weights_local_at == clock.t and r.weights_path == "/w/m.gguf" and r.started_at == clock.t
        assert runner.specs["r1"].env["HF_HUB_OFFLINE"] == "1" and fetcher.subscribers() == set()
        kinds = [e.kind for e in store.read_events(count=50)]
        assert "weights_download_started" in kinds and "weights_download_complete" in kinds
        assert fetcher.in_use  # the source of a running replica is never evicted
    finally:
        agent.close()


def test_the_engine_loads_the_downloaded_path_offline(tmp_path, monkeypatch):
    import fakeredis

    from llmgw.catalog import parse_catalog
    from llmgw.state.store import Store
    from tests.support.clock import FakeClock
    from tests.unit.test_agent_loop import agent_settings
    from workers.agent.launch import CatalogCache, Launcher

    gguf = tmp_path / "snapshots" / "c0ffee" / "m-Q4_1.gguf"
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"GGUF")
    monkeypatch.setenv("LLMGW_LLAMA_SERVER", "/bin/true")
    cat = parse_catalog({"models": [{"name": "m", "source": HF, "profiles": [{"name": "p", "engine": "llamacpp"}]}]})
    model, profile = cat.model("m"), cat.model("m").profile("p")
    store = Store(fakeredis.FakeRedis(decode_responses=True))
    launcher = Launcher(agent_settings(node_name="a"), store, CatalogCache(store, FakeClock()), (), lambda p: True)
    spec = launcher.command(rec(), model, profile, 30000, weights_path=str(gguf))
    assert spec.argv[spec.argv.index("-m") + 1] == str(gguf) and spec.env["HF_HUB_OFFLINE"] == "1"


def test_vllm_loads_the_snapshot_directory_offline_under_its_served_names(tmp_path):
    import fakeredis

    from llmgw.catalog import parse_catalog
    from llmgw.state.store import Store
    from tests.support.clock import FakeClock
    from tests.unit.test_agent_loop import agent_settings
    from workers.agent.launch import CatalogCache, Launcher

    cat = parse_catalog({"models": [{"name": "qwen", "aliases": ["q"], "source": "hf://Qwen/Qwen2.5-7B-Instruct",
                                     "profiles": [{"name": "g", "engine": "vllm", "gpu": {"class": "l4"}}]}]})
    store = Store(fakeredis.FakeRedis(decode_responses=True))
    launcher = Launcher(agent_settings(node_name="a"), store, CatalogCache(store, FakeClock()), (), lambda p: True)
    snap = str(tmp_path / "hub" / "models--Qwen--Qwen2.5-7B-Instruct" / "snapshots" / "abc")
    spec = launcher.command(rec(model="qwen", profile="g"), cat.model("qwen"), cat.model("qwen").profile("g"), 30000,
                            weights_path=snap)
    assert spec.argv[1:3] == ("serve", snap) and spec.env["HF_HUB_OFFLINE"] == "1"
    names = spec.argv[spec.argv.index("--served-model-name") + 1:]
    assert names[:2] == ("qwen", "q")


def test_engines_fit_workloads_come_from_the_profiles_args():
    from llmgw.catalog import parse_catalog
    from llmgw.engines import get_engine
    from llmgw.weights.meta import Shape

    shape = Shape(weights_bytes=1, layers=1, heads=1, kv_heads=1, head_dim=1, kv_elems_per_token=2,
                  context_length=32768)
    cat = parse_catalog({"models": [{"name": "m", "source": "hf://o/r", "profiles": [
        {"name": "v", "engine": "vllm", "gpu": {"class": "l4", "count": 2}, "tensor_parallel": 2,
         "args": ["--max-model-len=8192", "--gpu-memory-utilization", "0.8", "--kv-cache-dtype", "fp8"]},
        {"name": "c", "engine": "llamacpp", "source": "hf://o/r/x.gguf", "capacity": 3, "args": ["-ctk", "q8_0"]},
        {"name": "s", "engine": "sim"}]}]})
    m = cat.model("m")
    v = get_engine("vllm").fit_workload(m.profile("v"), shape)
    assert (v.context, v.sequences, v.tensor_parallel, v.gpu_memory_utilization, v.kv_bytes) == (8192, 256, 2, 0.8, 1)
    c = get_engine("llamacpp").fit_workload(m.profile("c"), shape)
    assert (c.context, c.sequences, c.devices, c.kv_bytes) == (3 * 2048, 3, 0, 34 / 32)
    assert get_engine("sim").fit_workload(m.profile("s"), shape) is None


def test_what_the_engine_reports_it_took_is_read_from_its_log():
    from llmgw.engines import get_engine

    llama = ("load_tensors:   CPU_Mapped model buffer size =    92.10 MiB\n"
             "llama_kv_cache:        CPU KV buffer size =   180.00 MiB\n"
             "llama_kv_cache: size =  180.00 MiB (  2048 cells,  30 layers,  4/4 seqs), K (f16):   90.00 MiB\n"
             "sched_reserve:        CPU compute buffer size =    16.64 MiB\n")
    assert get_engine("llamacpp").memory_report(llama) == "model 92.1 MiB, KV cache 180.0 MiB, compute 16.6 MiB"
    two_gpus = "CUDA0 KV buffer size =    90.00 MiB\nCUDA1 KV buffer size =    90.00 MiB\n"
    assert get_engine("llamacpp").memory_report(two_gpus) == "KV cache 180.0 MiB"
    vllm = ("INFO [gpu_model_runner.py:1234] Model loading took 14.9934 GiB and 5.12 seconds\n"
            "INFO [gpu_worker.py:240] Available KV cache memory: 38.59 GiB\n"
            "INFO [kv_cache_utils.py:716] GPU KV cache size: 1,264,528 tokens\n")
    assert get_engine("vllm").memory_report(vllm) == "weights 14.99 GiB, KV cache 38.59 GiB (1,264,528 tokens)"
    assert get_engine("llamacpp").memory_report("srv load_model: initializing") is None
