"""Model weights: what node agents read of each remote source (size and shape, for placement), who
is reading one now, and the pulls `llmgw models pull` asks of a node with their progress."""

from __future__ import annotations

import json
import time
from typing import Iterable, Iterator, Sequence

from llmgw.state import keys
from llmgw.state.weights import PullStatus, WeightsFacts
from llmgw.state.store.base import Aggregate, Pipeline, decoded, ms

PULL_STATUS_TTL = 24 * 3600.0


# --- reads a snapshot composes with other aggregates' -------------------------------------------------
def queue_sources(pipe: Pipeline) -> None:
    pipe.smembers(keys.WEIGHTS_SOURCES)


def queue_facts(pipe: Pipeline, sources: Sequence[str]) -> None:
    if sources:
        pipe.mget([keys.weights_source(s) for s in sources])


def take_facts(sources: Sequence[str], replies: Iterator) -> tuple[dict[str, WeightsFacts], list[str]]:
    """The facts of `sources`, and the sources whose record expired (to tidy from the set)."""
    raws = next(replies) if sources else []
    out, gone = {}, []
    for source, raw in zip(sources, raws):
        if raw is None:
            gone.append(source)
            continue
        for facts in decoded([raw], WeightsFacts.from_dict):
            out[source] = facts
    return out, gone


class Weights(Aggregate):
    def write_weights_facts(self, facts: WeightsFacts, ttl: float | None = None) -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.set(keys.weights_source(facts.source), json.dumps(facts.to_dict()), px=ms(ttl) if ttl else None)
        pipe.sadd(keys.WEIGHTS_SOURCES, facts.source)
        pipe.delete(keys.weights_claim(facts.source))
        pipe.execute()

    def weights_facts(self, sources: Iterable[str] | None = None) -> dict[str, WeightsFacts]:
        """Facts by source: of `sources`, or of every source that has some."""
        wanted = sorted(self.r.smembers(keys.WEIGHTS_SOURCES) if sources is None else set(sources))
        pipe = self.r.pipeline(transaction=False)
        queue_facts(pipe, wanted)
        facts, gone = take_facts(wanted, iter(pipe.execute()))
        if gone and sources is None:
            self.tidy_weights_sources(gone)
        return facts

    def tidy_weights_sources(self, gone: Iterable[str]) -> None:
        gone = list(gone)
        if gone:
            self.r.srem(keys.WEIGHTS_SOURCES, *gone)

    def claim_weights_read(self, source: str, node: str, ttl: float) -> bool:
        """Whether this node reads `source`'s headers now (no other agent claimed it within `ttl`)."""
        return bool(self.r.set(keys.weights_claim(source), node, nx=True, px=ms(ttl)))

    # --- pulls -----------------------------------------------------------------------------------------
    def request_pull(self, node: str, source: str, layout: str) -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(keys.weights_pulls(node), source, json.dumps({"layout": layout, "requested_at": time.time()}))
        pipe.hdel(keys.weights_pull_status(node), source)
        pipe.execute()

    def pull_requests(self, node: str) -> dict[str, str]:
        """Source -> layout of what `node` is asked to pull."""
        out = {}
        for source, raw in self.r.hgetall(keys.weights_pulls(node)).items():
            for d in decoded([raw], dict):
                out[source] = str(d.get("layout") or "")
        return out

    def write_pull_status(self, node: str, status: PullStatus, done: bool = False) -> None:
        """Record how a pull goes; `done` (complete or failed) also takes it off the node's list."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(keys.weights_pull_status(node), status.source, json.dumps(status.to_dict()))
        pipe.pexpire(keys.weights_pull_status(node), ms(PULL_STATUS_TTL))
        if done:
            pipe.hdel(keys.weights_pulls(node), status.source)
        pipe.execute()

    def pull_status(self, node: str) -> dict[str, PullStatus]:
        raws = self.r.hgetall(keys.weights_pull_status(node))
        return {s.source: s for s in decoded(raws.values(), PullStatus.from_dict)}
