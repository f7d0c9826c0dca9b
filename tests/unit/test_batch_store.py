"""The store's `batches` aggregate on fakeredis: files in chunks, listings, a line written and billed
once, sealing, leases, the feeders' counts and the batch workers' own key."""

from __future__ import annotations

import json

from llmgw.state import keys
from llmgw.state.batch_records import BatchRecord, FileRecord
from llmgw.state.keypolicy import hash_key
from llmgw.state.store.batches import BATCH_KEY_NAME, Bill


def batch(bid="b1", owner="k1", total=3, created=10.0) -> BatchRecord:
    return BatchRecord(id=bid, owner=owner, endpoint="/v1/chat/completions", input_file_id="f", completion_window="24h",
                       created_at=created, expires_at=created + 86400, total=total, model="m")


def test_a_file_is_its_chunks_and_a_record(store):
    store.append_file_chunk("f1", "a\n")
    store.append_file_chunk("f1", "b\n")
    assert store.r.ttl(keys.file_data("f1")) > 0  # an upload never committed expires
    assert store.file("f1") is None
    rec = FileRecord("f1", "k1", "x.jsonl", "batch", 4, 5.0, requests=2, chunks=2)
    store.commit_file(rec)
    assert store.r.ttl(keys.file_data("f1")) == -1 and store.file("f1") == rec
    assert list(store.file_chunks("f1")) == ["a\n", "b\n"]
    store.delete_file(rec)
    assert store.file("f1") is None and list(store.file_chunks("f1")) == []


def test_listings_are_per_owner_newest_first_and_paged(store):
    for i in range(5):
        store.create_batch(batch(f"b{i}", owner="k1" if i % 2 == 0 else "k2", created=float(i)))
    assert [b.id for b in store.list_batches("k1")] == ["b4", "b2", "b0"]
    assert [b.id for b in store.list_batches("k1", after="b4", limit=1)] == ["b2"]
    assert [b.id for b in store.list_batches(None, limit=2)] == ["b4", "b3"]
    assert store.list_batches("k1", after="nope") == []
    assert store.active_batch_ids() == ["b0", "b1", "b2", "b3", "b4"]


def test_a_line_is_written_counted_and_billed_once(store):
    store.create_batch(batch())
    bill = Bill("k1", "m", "2026-12", 3600)
    assert store.record_line("b1", 0, True, '{"x":1}', 5, 7, bill) == 1
    assert store.record_line("b1", 0, True, '{"x":2}', 5, 7, bill) == 0  # answered twice: kept once
    assert store.record_line("b1", 0, False, '{"e":1}', 0, 0, None) == 0
    assert store.record_line("b1", 1, False, '{"e":1}', 0, 0, None) == 1
    b = store.batch("b1")
    assert (b.n_completed, b.n_failed, b.prompt_tokens, b.completion_tokens, b.out_bytes, b.err_bytes) == (1, 1, 5, 7, 8, 8)
    assert store.r.hgetall(keys.usage("k1")) == {"m:prompt": "5", "m:completion": "7", "m:requests": "1"}
    assert store.budget_spent("k1", "2026-12") == 12 and store.r.ttl(keys.budget("k1", "2026-12")) > 0
    assert store.answered("b1", [0, 1, 2]) == {0, 1}
    assert [list(p) for p in store.result_lines("b1", "output", 3)] == [['{"x":1}']]
    assert [list(p) for p in store.result_lines("b1", "error", 3)] == [['{"e":1}']]


def test_nothing_is_written_after_the_seal(store):
    store.create_batch(batch())
    assert store.seal_batch("b1", sealed_at=1.0, sealed_as="cancelled", finalizing_at=1.0)
    assert not store.seal_batch("b1", sealed_at=2.0, sealed_as="completed")
    assert store.record_line("b1", 2, True, "{}") == -1
    assert not store.update_batch("b1", cancelling_at=3.0)  # a sealed batch is final
    assert store.batch("b1").sealed_as == "cancelled" and "b1" in store.active_batch_ids()
    assert store.finish_batch("b1", "cancelled", cancelled_at=4.0)
    assert store.batch("b1").status == "cancelled" and store.active_batch_ids() == []
    assert store.finish_batch("b1", "cancelled", cancelled_at=5.0)  # again (a run finishing it twice) ...
    assert store.batch_stats() == ([], {"cancelled": 1})  # ... counts it once
    assert store.record_line("gone", 0, True, "{}") == -1


def test_one_lease_at_a_time(store):
    assert store.take_batch_lease("b1", "t1", 5) and not store.take_batch_lease("b1", "t2", 5)
    assert store.renew_batch_lease("b1", "t1", 5) and not store.renew_batch_lease("b1", "t2", 5)
    assert store.batch_leases(["b1", "b2"]) == {"b1": True, "b2": False}
    store.release_batch_lease("b1", "t2")  # not its holder: nothing
    assert store.batch_leases(["b1"]) == {"b1": True}
    store.release_batch_lease("b1", "t1")
    assert store.mark_batch_queued("b1", 10) and not store.mark_batch_queued("b1", 10)
    assert store.batch_leases(["b1"]) == {"b1": True}  # a run is on its way
    store.clear_batch_queued("b1")
    assert store.batch_leases(["b1"]) == {"b1": False}


def test_feeders_are_forgotten_when_silent(store):
    store.write_feeder("m", "t1", 4, 100.0)
    store.write_feeder("m", "t2", 2, 90.0)
    assert [(f.token, f.inflight) for f in store.feeders("m", 101.0, 3.0)] == [("t1", 4)]
    assert store.r.hkeys(keys.batch_feeders("m")) == ["t1"]
    store.drop_feeder("m", "t1")
    assert store.feeders("m", 101.0, 3.0) == []


def test_the_batch_workers_key_is_made_once_and_replaced_when_revoked(store):
    k1 = store.ensure_batch_credential(now=1.0)
    assert store.ensure_batch_credential(now=2.0) == k1
    [rec] = [r for r in store.list_keys() if r.name == BATCH_KEY_NAME]
    assert rec.priority == "batch" and rec.hash == hash_key(k1)
    store.revoke_key(BATCH_KEY_NAME)
    k2 = store.ensure_batch_credential(now=3.0)
    assert k2 != k1 and [r.hash for r in store.list_keys() if r.name == BATCH_KEY_NAME] == [hash_key(k2)]
    assert store.key_record(rec.id) is None
    assert json.loads(store.r.hget(keys.API_KEYS, store.list_keys()[0].id))["priority"] == "batch"
