"""The loopback hub speaks what the real huggingface_hub client asks, and the client behaves as
llmgw/weights/hub.py assumes (these fail first if a new huggingface_hub changes either)."""

from __future__ import annotations

import pytest
from huggingface_hub import HfApi, hf_hub_download, snapshot_download
from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError

from harness.fakehub import FakeHub, tiny_model_files

MIB = 1024 * 1024


@pytest.fixture
def hub():
    h = FakeHub().start()
    yield h
    h.stop()


def test_hf_hub_download_heads_then_gets_from_the_cdn_without_the_token(tmp_path, hub):
    files = {**tiny_model_files(), "big.safetensors": bytes(3 * MIB)}
    commit = hub.add_repo("org/tiny", files)
    hub.require_token = "hf_ok"
    path = hf_hub_download("org/tiny", "big.safetensors", endpoint=hub.endpoint, cache_dir=tmp_path, token="hf_ok")
    assert path.endswith(f"models--org--tiny/snapshots/{commit}/big.safetensors")
    log = [(e["method"], e["path"].split("?")[0], e["auth"]) for e in hub.log]
    sha = hub.repos["org/tiny"].commits[commit]["big.safetensors"].sha256
    assert log == [("HEAD", "/org/tiny/resolve/main/big.safetensors", True), ("GET", f"/blobs/{sha}", False)]
    assert (tmp_path / "models--org--tiny" / "refs" / "main").read_text() == commit


def test_snapshot_download_lists_the_tree_at_the_commit(tmp_path, hub):
    commit = hub.add_repo("org/tiny", tiny_model_files())
    snapshot_download("org/tiny", endpoint=hub.endpoint, cache_dir=tmp_path, token=False)
    paths = [e["path"].split("?")[0] for e in hub.log]
    assert paths[:2] == ["/api/models/org/tiny/revision/main", f"/api/models/org/tiny/tree/{commit}"]
    heads = sorted(e["path"] for e in hub.log if e["method"] == "HEAD")
    assert heads == sorted(f"/org/tiny/resolve/{commit}/{n}" for n in tiny_model_files())


def test_model_info_with_files_metadata_gives_sizes_and_lfs_sha256(hub):
    commit = hub.add_repo("org/tiny", tiny_model_files())
    info = HfApi(endpoint=hub.endpoint, token=False).model_info("org/tiny", files_metadata=True)
    assert info.sha == commit
    st = next(s for s in info.siblings if s.rfilename == "model.safetensors")
    assert st.lfs.sha256 == hub.repos["org/tiny"].commits[commit]["model.safetensors"].sha256
    cfg = next(s for s in info.siblings if s.rfilename == "config.json")
    assert cfg.lfs is None and cfg.blob_id == hub.repos["org/tiny"].commits[commit]["config.json"].git_sha1
    tree = HfApi(endpoint=hub.endpoint, token=False).list_repo_tree("org/tiny")
    assert sorted(f.path for f in tree) == sorted(tiny_model_files())
    assert [p.path for p in HfApi(endpoint=hub.endpoint, token=False).get_paths_info("org/tiny", ["config.json"])] \
        == ["config.json"]


def test_the_clients_errors_for_401_and_404(tmp_path, hub):
    hub.add_repo("org/tiny", tiny_model_files())
    with pytest.raises(EntryNotFoundError):
        hf_hub_download("org/tiny", "nope.bin", endpoint=hub.endpoint, cache_dir=tmp_path, token=False)
    hub.require_token = "hf_ok"
    with pytest.raises(RepositoryNotFoundError):
        HfApi(endpoint=hub.endpoint, token=False).model_info("org/tiny")


def test_hf_hub_download_resumes_only_within_one_call_and_drops_its_partial_on_failure(tmp_path, hub):
    """Why llmgw fetches the bytes itself: a cut connection is resumed inside the call (Range), from
    the last whole 10 MiB chunk it wrote, but a failed call removes its per-process
    `<etag>.<uuid>.incomplete`, so nothing survives a restart."""
    commit = hub.add_repo("org/tiny", {"big.safetensors": bytes(range(256)) * (96 * 1024)})  # 24 MiB
    sha = hub.repos["org/tiny"].commits[commit]["big.safetensors"].sha256
    hub.cut_after[sha] = 12 * MIB
    hf_hub_download("org/tiny", "big.safetensors", endpoint=hub.endpoint, cache_dir=tmp_path, token=False)
    gets = hub.requests("GET", f"/blobs/{sha}")
    assert [g["range"] for g in gets] == [None, f"bytes={10 * MIB}-"]  # 2 MiB fetched twice
    hub.blobs.clear()  # the CDN now fails every GET: the call fails
    with pytest.raises(Exception):
        hf_hub_download("org/tiny", "big.safetensors", endpoint=hub.endpoint, cache_dir=tmp_path / "b",
                        token=False, force_download=True)
    assert not list((tmp_path / "b").rglob("*.incomplete"))
