"""The node's weights cache: LRU eviction that spares running replicas, the room check, manifests."""

from __future__ import annotations

from pathlib import Path

from llmgw.weights import cache
from llmgw.weights.cache import GIB, Entry, evict, room

MIB = 1024 ** 2


def e(key, size, last_used, files=None, links=()):
    return Entry(key=key, source=f"hf://o/{key}", path=f"/c/{key}", files=files or ((f"blobs/{key}", size),),
                 links=links, last_used=last_used)


def test_evict_least_recently_used_first_until_it_fits():
    a, b, c = e("a", 10 * GIB, 1), e("b", 10 * GIB, 2), e("c", 10 * GIB, 3)
    assert evict([c, a, b], set(), budget=30 * GIB) == ()
    assert evict([c, a, b], set(), budget=30 * GIB, needed=5 * GIB) == (a,)
    assert evict([c, a, b], set(), budget=30 * GIB, needed=15 * GIB) == (a, b)


def test_evict_never_removes_weights_a_replica_uses():
    a, b, c = e("a", 10 * GIB, 1), e("b", 10 * GIB, 2), e("c", 10 * GIB, 3)
    assert evict([a, b, c], {"a"}, budget=30 * GIB, needed=5 * GIB) == (b,)
    # Even when nothing else is enough, the in-use entries stay.
    assert evict([a, b, c], {"a", "b"}, budget=10 * GIB, needed=10 * GIB) == (c,)


def test_a_shared_blob_is_freed_only_with_its_last_user():
    shared = ("blobs/s", 8 * GIB)
    a = e("a", 0, 1, files=(shared,))
    b = e("b", 0, 2, files=(shared, ("blobs/b", 1 * GIB)))
    assert cache.used_bytes([a, b]) == 9 * GIB
    # Removing a frees nothing (b keeps the blob): it is skipped; b is next.
    assert evict([a, b], set(), budget=8 * GIB) == (b,)
    assert evict([a, b], {"b"}, budget=8 * GIB) == ()


def test_room_says_how_much_is_needed_and_free():
    r = room(int(14.2 * GIB), int(9.1 * GIB), "/var/lib/llmgw/weights")
    assert not r.ok and r.problem == "needs 14.2 GiB, 9.1 GiB free under /var/lib/llmgw/weights"
    assert room(5 * MIB, 10 * MIB, "/w").ok
    assert room(20 * MIB, 10 * MIB, "/w").problem == "needs 20.0 MiB, 10.0 MiB free under /w"


def test_room_counts_what_eviction_would_free_and_the_budget():
    old, running = e("old", 10 * GIB, 1), e("run", 10 * GIB, 2)
    r = room(8 * GIB, 2 * GIB, "/w", entries=[old, running], in_use={"run"}, budget=20 * GIB)
    assert r.ok and r.evict == (old,) and r.budget_left == 10 * GIB
    r = room(12 * GIB, 100 * GIB, "/w", entries=[old, running], in_use={"run"}, budget=20 * GIB)
    assert not r.ok and r.problem.startswith("needs 12.0 GiB, the weights budget has 10.0 GiB left of 20.0 GiB")


def test_manifests_round_trip_touch_and_remove(tmp_path: Path):
    for rel in ("hub/m/blobs/x", "hub/m/blobs/shared"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"1234")
    (tmp_path / "hub/m/snapshots/c1").mkdir(parents=True)
    (tmp_path / "hub/m/snapshots/c1/x").symlink_to("../../blobs/x")
    one = Entry(key=cache.source_key("hf://o/one"), source="hf://o/one", path=str(tmp_path / "hub/m/snapshots/c1/x"),
                files=(("hub/m/blobs/x", 4), ("hub/m/blobs/shared", 4)), links=("hub/m/snapshots/c1/x",),
                commit="c1", completed_at=5.0, last_used=5.0)
    two = Entry(key=cache.source_key("hf://o/two"), source="hf://o/two", path="p", files=(("hub/m/blobs/shared", 4),))
    cache.write_entry(tmp_path, one)
    cache.write_entry(tmp_path, two)
    assert sorted(x.key for x in cache.read_index(tmp_path)) == sorted([one.key, two.key])
    assert cache.lookup(tmp_path, "hf://o/one") == one
    assert cache.touch(tmp_path, one, 99.0).last_used == 99.0 and cache.lookup(tmp_path, "hf://o/one").last_used == 99.0
    freed = cache.remove(tmp_path, one, cache.read_index(tmp_path))
    assert freed == 4 and cache.lookup(tmp_path, "hf://o/one") is None
    assert not (tmp_path / "hub/m/blobs/x").exists() and (tmp_path / "hub/m/blobs/shared").exists()
    assert not (tmp_path / "hub/m/snapshots").exists()  # emptied directories go too


def test_a_manifest_whose_files_are_gone_is_not_complete(tmp_path: Path):
    entry = Entry(key=cache.source_key("hf://o/x"), source="hf://o/x", path="p", files=(("url/k/x.gguf", 3),))
    cache.write_entry(tmp_path, entry)
    assert cache.lookup(tmp_path, "hf://o/x") is None
    (tmp_path / "index" / "garbage.json").write_text("{not json")
    assert cache.read_index(tmp_path) == [entry]


def test_headroom_is_free_disk_plus_what_eviction_frees_within_the_budget():
    from llmgw.weights.cache import Entry, headroom

    a = Entry("a", "hf://o/a", "/w/a", (("hub/x", 40),))
    b = Entry("b", "hf://o/b", "/w/b", (("hub/x", 40), ("hub/y", 10)))  # shares x with a
    c = Entry("c", "hf://o/c", "/w/c", (("hub/z", 30),))
    assert headroom([a, b, c], set(), free=100) == 180  # everything evictable
    assert headroom([a, b, c], {"a"}, free=100) == 140  # x stays with a: b frees only y
    assert headroom([a, b, c], {"a"}, free=100, budget=120) == 80  # the budget less what a holds
    assert headroom([a, b, c], {"a", "b", "c"}, free=5, budget=50) == 0
