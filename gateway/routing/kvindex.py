"""What each replica's prefix cache holds, from the engine's own KV events (precise mode).

The engine names its blocks by hashes the gateway cannot recompute (vLLM's are seeded per process
unless PYTHONHASHSEED is fixed, and are over token ids). The events carry each stored block's token
ids, so the index names every block again by a hash of its own, chained the same way over the same
tokens (and seeded by the adapter and cache salt, as the engine's chain is): a request tokenized as
the engine tokenizes it then finds its longest cached prefix by walking its own chain, block by
block, with no engine hash involved. Removal events name engine hashes; the index keeps the map.

Batches are numbered from 0 by each engine process; a gap (a dropped message, or a gateway that
started listening mid-stream) asks the shell for a replay from the first missing number, and the
batches after it wait so that all are folded in order. A number lower than expected is an engine
that started again: its cache is empty, and so is its entry here.

Pure: no sockets, no clock. The shell (gateway.server.kvevents) feeds it through `SharedIndex`, which
holds its lock (the router reads it under the same lock).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Hashable, Sequence

from llmgw.engines.kvwire import AllCleared, Batch, BlocksRemoved, BlocksStored

ROOT = ("llmgw-kv-root",)


def first_key(lora: str | None, salt: str | None) -> Hashable:
    """What a chain's first block hangs from: different adapters or salts never share a block."""
    return (ROOT, lora or "", salt or "")


def chain_keys(tokens: Sequence[int], block_size: int, lora: str | None = None, salt: str | None = None,
               limit: int | None = None) -> list[int]:
    """The index's names for the full blocks of `tokens`, chained (each names its whole prefix)."""
    out: list[int] = []
    parent: Hashable = first_key(lora, salt)
    n = len(tokens) // block_size if limit is None else min(limit, len(tokens) // block_size)
    for i in range(n):
        parent = hash((parent, tuple(tokens[i * block_size:(i + 1) * block_size])))
        out.append(parent)
    return out


@dataclass
class EndpointBlocks:
    """One replica's cached blocks: the index's key of each engine block, and their count."""

    block_size: int = 0
    by_engine: dict | None = None  # engine hash -> the index's key
    keys: set | None = None

    def __post_init__(self) -> None:
        self.by_engine = {} if self.by_engine is None else self.by_engine
        self.keys = set() if self.keys is None else self.keys


class Index:
    """The blocks of every replica that publishes KV events, by endpoint id."""

    def __init__(self) -> None:
        self.endpoints: dict[str, EndpointBlocks] = {}
        self.next_seq: dict[str, int] = {}
        self.gaps: dict[str, int] = {}  # endpoint -> how many batches were missed and not replayed
        self.orphans: dict[str, int] = {}  # endpoint -> stored blocks whose parent the index never saw
        self.waiting: dict[str, list[Batch]] = {}  # endpoint -> batches after a gap, until its replay ends

    # --- the events ----------------------------------------------------------------------------------
    def apply(self, endpoint: str, batch: Batch) -> int | None:
        """Fold one published batch in. Returns the first missing sequence number when this batch
        opens a gap (the shell asks the replay socket for everything from there, then calls
        `replay_done`); while a gap is open, later batches wait so that every batch is folded in order."""
        expected = self.next_seq.get(endpoint)
        if endpoint in self.waiting:
            self.waiting[endpoint].append(batch)
            return None
        if expected is not None and batch.seq < expected:
            # A publisher only counts up: a lower number is an engine that started again, with an
            # empty cache (and its numbers from 0).
            self.forget(endpoint)
            expected = None
        if expected is None and batch.seq > 0:
            expected = 0  # first heard mid-stream: what it cached before is in the replay buffer
        if expected is not None and batch.seq > expected:
            self.next_seq.setdefault(endpoint, expected)
            self.waiting[endpoint] = [batch]
            return expected
        self._fold(endpoint, batch)
        return None

    def replayed(self, endpoint: str, batch: Batch) -> None:
        """A batch the replay socket sent: folded if it is the next one."""
        if batch.seq == self.next_seq.get(endpoint, batch.seq):
            self._fold(endpoint, batch)

    def replay_done(self, endpoint: str) -> None:
        """The replay ended (or failed): fold the batches that waited; what is still missing is lost."""
        for batch in sorted(self.waiting.pop(endpoint, ()), key=lambda b: b.seq):
            expected = self.next_seq.get(endpoint, batch.seq)
            if batch.seq < expected:
                continue
            if batch.seq > expected:
                self.missed(endpoint, batch.seq - expected)
            self._fold(endpoint, batch)

    def _fold(self, endpoint: str, batch: Batch) -> None:
        self.next_seq[endpoint] = batch.seq + 1
        blocks = self.endpoints.setdefault(endpoint, EndpointBlocks())
        for e in batch.events:
            if isinstance(e, BlocksStored):
                self._stored(endpoint, blocks, e)
            elif isinstance(e, BlocksRemoved):
                for h in e.block_hashes:
                    key = blocks.by_engine.pop(h, None)
                    if key is not None:
                        blocks.keys.discard(key)
            elif isinstance(e, AllCleared):
                blocks.by_engine.clear()
                blocks.keys.clear()

    def missed(self, endpoint: str, count: int) -> None:
        """Batches lost for good (no replay socket, or its buffer had moved on)."""
        self.gaps[endpoint] = self.gaps.get(endpoint, 0) + count

    def forget(self, endpoint: str) -> None:
        """The endpoint left the list, or its engine restarted (its cache is empty again)."""
        self.endpoints.pop(endpoint, None)
        self.next_seq.pop(endpoint, None)
        self.waiting.pop(endpoint, None)

    def _stored(self, endpoint: str, blocks: EndpointBlocks, e: BlocksStored) -> None:
        size = e.block_size or blocks.block_size
        if size <= 0:
            return
        blocks.block_size = size
        if e.parent is None:
            parent: Hashable = first_key(e.lora, e.salt)
        else:
            parent = blocks.by_engine.get(e.parent)
            if parent is None:  # its parent was stored before we listened, or evicted: unreachable
                self.orphans[endpoint] = self.orphans.get(endpoint, 0) + len(e.block_hashes)
                return
        for i, h in enumerate(e.block_hashes):
            toks = e.token_ids[i * size:(i + 1) * size]
            if len(toks) < size:
                break
            parent = hash((parent, tuple(toks)))
            blocks.by_engine[h] = parent
            blocks.keys.add(parent)

    # --- the request path ----------------------------------------------------------------------------
    def block_size(self, endpoint: str) -> int:
        b = self.endpoints.get(endpoint)
        return b.block_size if b is not None else 0

    def listening(self, endpoint: str) -> bool:
        """The index has heard from this endpoint (its view is the engine's, not a guess)."""
        return endpoint in self.next_seq

    def cached_tokens(self, endpoint: str, keys: Sequence[int], prompt_len: int) -> int:
        """How many of a prompt's leading tokens the endpoint holds: whole blocks, and never the last
        token (an engine always computes at least one: vLLM stops one short of the full prompt)."""
        b = self.endpoints.get(endpoint)
        if b is None or not b.block_size:
            return 0
        limit = max(0, (prompt_len - 1) // b.block_size)
        n = 0
        for k in keys[:limit]:
            if k not in b.keys:
                break
            n += 1
        return n * b.block_size

    def size(self, endpoint: str) -> int:
        b = self.endpoints.get(endpoint)
        return len(b.keys) if b is not None else 0

    def folded(self, endpoint: str) -> int:
        """The number of the endpoint's last batch folded in, in order (-1: none, or its engine started
        again): what was published up to it is in the index."""
        return self.next_seq.get(endpoint, 0) - 1


class SharedIndex:
    """The index as the gateway process shares it between its KV-events loop (the writer) and the
    request path (the reader): each call takes the lock for its own duration only."""

    def __init__(self, index: Index | None = None):
        self.index = index if index is not None else Index()
        self.lock = threading.Lock()

    def apply(self, endpoint: str, batch: Batch) -> int | None:
        with self.lock:
            return self.index.apply(endpoint, batch)

    def replayed(self, endpoint: str, batch: Batch) -> None:
        with self.lock:
            self.index.replayed(endpoint, batch)

    def replay_done(self, endpoint: str) -> None:
        with self.lock:
            self.index.replay_done(endpoint)

    def forget(self, endpoint: str) -> None:
        with self.lock:
            self.index.forget(endpoint)

    def progress(self, endpoint: str) -> tuple[int, int]:
        """(the last batch folded in, the blocks held) of one endpoint."""
        with self.lock:
            return self.index.folded(endpoint), self.index.size(endpoint)
