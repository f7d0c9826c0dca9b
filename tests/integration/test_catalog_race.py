"""Two appliers that diffed against the same version: exactly one wins (real redis-server)."""

from __future__ import annotations

import threading

from llmgw.catalog import apply_catalog, parse_catalog_text, read_applied
from llmgw.errors import CatalogConflict
from llmgw.state.store import Store, connect


def cat(name: str, replicas: int):
    return parse_catalog_text(f"models:\n  - {{name: {name}, profiles: [{{name: s, engine: sim, replicas: {replicas}}}]}}\n")


def test_concurrent_apply_exactly_one_wins(redis_server):
    rounds = 20
    for i in range(rounds):
        clients = [Store(connect(redis_server)), Store(connect(redis_server))]
        version, _, _ = read_applied(clients[0])  # both diff against the same version
        barrier = threading.Barrier(2)
        outcomes: list[object] = [None, None]

        def applier(k: int) -> None:
            barrier.wait(30)
            try:
                outcomes[k] = apply_catalog(clients[k], cat(f"m{k}", i + 1), source=f"applier{k}",
                                            applied_by=f"applier{k}", expected_version=version)
            except CatalogConflict as e:
                outcomes[k] = e

        threads = [threading.Thread(target=applier, args=(k,)) for k in range(2)]
        try:
            for t in threads:
                t.start()
        finally:
            for t in threads:
                if t.ident is not None:  # started
                    t.join(30)
        assert not any(t.is_alive() for t in threads), f"round {i}: an applier never finished"
        wins = [o for o in outcomes if isinstance(o, tuple)]
        losses = [o for o in outcomes if isinstance(o, CatalogConflict)]
        assert len(wins) == 1 and len(losses) == 1, outcomes
        assert wins[0] == (version + 1, True)
        assert (losses[0].expected, losses[0].actual) == (version, version + 1)
        winner = outcomes.index(wins[0])
        now_version, applied, meta = read_applied(clients[0])
        assert now_version == version + 1 and meta["applied_by"] == f"applier{winner}"
        assert applied.model(f"m{winner}") is not None
        for c in clients:
            c.close()
    assert [h["version"] for h in Store(connect(redis_server)).catalog_history(rounds)] == list(range(rounds, 0, -1))


def test_a_write_between_read_and_commit_is_caught_by_watch(redis_server):
    """Deterministic interleaving: another applier commits after our read but before our EXEC."""
    import redis as redis_lib

    other = Store(connect(redis_server))

    class Interleaving(redis_lib.Redis):
        def transaction(self, func, *watches, **kw):
            attempts = []

            def wrapped(pipe):
                result = func(pipe)  # our read and queued write; EXEC comes after this returns
                if not attempts:
                    apply_catalog(other, cat("intruder", 9), source="other", applied_by="other")
                attempts.append(result)
                return result

            try:
                return super().transaction(wrapped, *watches, **kw)
            finally:
                self.attempts = len(attempts)

    mine = Interleaving.from_url(redis_server, decode_responses=True)
    mine_store = Store(mine)
    apply_catalog(other, cat("base", 1), source="x", applied_by="x")
    try:
        apply_catalog(mine_store, cat("mine", 2), source="me", applied_by="me", expected_version=1)
        raise AssertionError("expected CatalogConflict")
    except CatalogConflict as e:
        assert (e.expected, e.actual) == (1, 2)
    version, applied, meta = read_applied(other)
    assert version == 2 and applied.model("intruder") is not None and meta["applied_by"] == "other"
    assert mine.attempts == 1  # the first EXEC was refused by WATCH; the retry found the new version
