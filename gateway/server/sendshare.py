"""What this gateway sent where, exchanged with the other gateways through Redis, off the request path.

Behind an L4 load balancer the turns of one conversation reach different gateways. Each gateway's
prefix index knows only what it sent (its gunicorn workers share theirs in memory,
gateway.server.sentlog), so a turn that reaches another gateway than its previous one finds no
endpoint holding its history there and is placed by its system prompt's head alone, and loses the
prefill its history would have saved (`python -m bench.prefix --routers llmgw,llmgw-2gw` counts the
turns moved and the hits; docs/history.md has the runs before this exchange).

A conversation's next turn comes a think time after the last answer, seconds rather than
milliseconds, so the gateways need not agree per request (a round trip on every decision). Each
worker runs two loops: every `interval` it appends what it sent since its last flush to its
gateway's stream (llmgw.state.store.sends), and it reads the other gateways' streams as entries
arrive (a read that waits in Redis, so an idle fleet costs nothing and a lone gateway reads nothing),
into its prefix index and prefill backlog (gateway.routing.exchange: `learn_sends`). A send reaches
the other gateways within about one interval. A gateway that starts, or that sees a new one, reads that
gateway's stream from its beginning, the last KEEP seconds of its sends, so it routes conversations
under way as the others do.

A gateway alone writes nothing but its name, once every ORIGINS_EVERY: encoding and appending its
sends cost it a large share of its CPU per request (`python -m bench.hotpath`, against `--set
LLMGW_GATEWAY_SHARE_SENDS=0`), for no reader. It keeps what it sent in its outbox meanwhile (the last
OUTBOX_MAX sends, gateway.routing.inflight), and once it sees another gateway announce itself (within
ORIGINS_EVERY) it publishes them and shares from then on. So a gateway that starts beside a lone one
learns at most OUTBOX_MAX of its past sends (all of them at conversational rates; the last seconds
at thousands of requests a second, older turns then placed by their head's hash as before). When Redis fails, the sends of that pass are dropped (stale by the next
one), the failure is logged once, and the loops go on.
"""

from __future__ import annotations

import logging
import threading

from gateway.observe.health import REDIS_ERRORS
from gateway.routing.exchange import Exchange
from llmgw.state.clock import Clock
from llmgw.state.store import Store

log = logging.getLogger("llmgw.gateway")

# Seconds of sends a stream keeps (trimmed as it is written): what a starting gateway learns from.
# A turn after a longer pause is placed by its head's hash, as the gateways agree on without sharing.
KEEP = 120.0
READ_BATCH = 500  # entries per origin and read; a pass reads on until drained or READS_PER_PASS
READS_PER_PASS = 20
READ_WAIT = 1.0  # seconds a read waits in Redis for another gateway's flush before it looks again
ORIGINS_EVERY = 1.0  # seconds between reads of which gateways share (a new one is read from then on)


class SendShare:
    """The two loops over `exchange` (its counts made with an outbox when `interval` > 0: gateway.app)."""

    def __init__(self, store: Store, exchange: Exchange, clock: Clock, interval: float, origin: str, metrics=None):
        self.store, self.exchange, self.clock, self.metrics = store, exchange, clock, metrics
        self.interval, self.origin = interval, origin
        self.cursors: dict[str, str] = {}  # another origin -> the position read up to in its stream
        self._origins_at = self._announced_at = float("-inf")
        self.stopping = threading.Event()
        self._failing: set[str] = set()
        self.peers = False  # another gateway shares (seen by `read`): until then nothing is published

    def start(self) -> None:
        if self.interval <= 0:
            return
        threading.Thread(target=self._flush_loop, name="llmgw-sends-out", daemon=True).start()
        threading.Thread(target=self._read_loop, name="llmgw-sends-in", daemon=True).start()

    def stop(self) -> None:
        self.stopping.set()

    def _flush_loop(self) -> None:
        while not self.stopping.wait(self.interval):
            self._guarded("publishing", self.flush)

    def _read_loop(self) -> None:
        while not self.stopping.is_set():
            read = self._guarded("reading", lambda: self.read(READ_WAIT))
            if read is None:  # no other gateway shares, or Redis failed: look again in a while
                self.stopping.wait(ORIGINS_EVERY)

    def _guarded(self, what: str, step):
        try:
            out = step()
            self._failing.discard(what)
            return out
        except REDIS_ERRORS as e:
            if what not in self._failing:  # once per outage: the pollers report Redis's health
                log.warning("%s sends with the other gateways failed: %s", what, e)
            self._failing.add(what)
        except Exception:  # noqa: BLE001 - the loops never die
            log.exception("%s sends with the other gateways failed", what)
        return None

    def flush(self) -> int:
        """Publish what this worker sent since the last flush, and what the gateway holds when it is
        time to say it (gateway.routing.othergateways), once another gateway shares; and every
        ORIGINS_EVERY, that this one does. Returns how many sends."""
        now = self.clock.monotonic()
        announce = now - self._announced_at >= ORIGINS_EVERY
        ours = self.exchange.take_sends() if self.peers else []
        holds = self.exchange.take_holds() if self.peers else None
        if ours or holds is not None:
            self.store.add_sends(self.origin, ours, self.clock.time(), KEEP, announce, holds)
            if self.metrics is not None:
                self.metrics.child(self.metrics.sends_shared, "published").inc(len(ours))
        elif announce:  # nothing to say (or alone): still say that this gateway shares
            self.store.announce_sends(self.origin, self.clock.time())
        if announce:
            self._announced_at = now
        return len(ours)

    def read(self, block: float | None = None) -> int | None:
        """Learn what the other gateways sent since the last read, waiting up to `block` seconds for
        it when nothing is there yet. Returns how many sends were learned (None: no other gateway
        shares)."""
        now = self.clock.monotonic()
        if now - self._origins_at >= ORIGINS_EVERY:
            self._origins_at = now
            others = [o for o in self.store.sending_origins(self.clock.time(), KEEP) if o != self.origin]
            self.cursors = {o: self.cursors.get(o, "0-0") for o in others}
            self.peers = bool(others)
        if not self.cursors:
            self._show_remote()
            return None
        learned = 0
        for i in range(READS_PER_PASS):
            self.cursors, read, theirs, holds = self.store.sends_after(self.cursors, READ_BATCH,
                                                                       block if i == 0 else None)
            self.exchange.learn_sends(theirs)
            for h in holds:
                self.exchange.learn_holds(h.origin, h.counts, h.at)
            learned += len(theirs)
            if read < READ_BATCH:
                break
        if learned and self.metrics is not None:
            self.metrics.child(self.metrics.sends_shared, "learned").inc(learned)
        self._show_remote()
        return learned

    def _show_remote(self) -> None:
        """What the other gateways hold, as routing counts it now, into the metric (a gateway gone
        silent drops out of it here too)."""
        if self.metrics is not None:
            for endpoint_id, n in self.exchange.remote_held().items():
                self.metrics.child(self.metrics.other_gateways_inflight, endpoint_id).set(n)

    def step(self) -> int | None:
        """One flush and one read that does not wait (tests); then one more flush when that read
        found the first other gateway, as the flush loop's next tick would."""
        self.flush()
        self._origins_at = float("-inf")
        alone = not self.peers
        read = self.read()
        if alone and self.peers:
            self.flush()
        return read
