"""The gateway's subscriptions to the engines' KV cache events (precise prefix routing).

One thread per gateway process holds a ZMQ SUB socket per endpoint that publishes events (the
endpoint list says where: `EndpointInfo.kv_events`), folds each batch into the shared
`gateway.routing.kvindex.Index` (through `SharedIndex`, which takes its lock), and on a gap asks that endpoint's replay socket for
the missing batches (a DEALER, as vLLM's replay socket is a ROUTER). Endpoints that leave the list are
unsubscribed and forgotten; the tokenizers their prompts are matched with are loaded here too
(gateway.server.tokenizers), never on the request path. After each batch, and when an endpoint is
subscribed or forgotten, `observe(endpoint, last batch folded, blocks held)` is told where the index
stands (the gateway's metrics: a test or an operator sees what the index has heard). pyzmq is imported only when an endpoint publishes events; under gunicorn's
gevent worker its cooperative flavour (zmq.green) is used, so a wait never blocks other requests.

The loop never dies: a failure is logged and the next pass goes on.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Sequence

Observe = Callable[[str, int, int], None]  # (endpoint id, last batch folded or -1, blocks held)

from gateway.routing.kvindex import SharedIndex
from gateway.server.tokenizers import Tokenizers
from llmgw.engines.kvwire import WireError, decode_message, decode_replay, replay_request
from llmgw.state.records import EndpointInfo

log = logging.getLogger("llmgw.gateway")

POLL_MS = 200
REPLAY_TIMEOUT_MS = 1000
MAX_REPLAY = 20_000  # batches one replay may return (vLLM buffers 10 000 steps by default)


def _zmq():
    try:
        from gevent import monkey

        if monkey.is_module_patched("socket"):
            import zmq.green as zmq  # noqa: PLC0415

            return zmq
    except ImportError:
        pass
    import zmq  # noqa: PLC0415

    return zmq


class KvSubscriber:
    def __init__(self, index: SharedIndex, endpoints: Callable[[], Sequence[EndpointInfo]],
                 tokenizers: Tokenizers | None = None, observe: Observe | None = None):
        self.index, self.endpoints, self.tokenizers = index, endpoints, tokenizers
        self.observe = observe
        self.stopping = threading.Event()
        self._subs: dict[str, tuple[str, object]] = {}  # endpoint id -> (its kv_events address, SUB socket)
        self._replay_at: dict[str, str] = {}
        self._zmq = None
        self._ctx = None
        self._warned: set[str] = set()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self._loop, name="llmgw-kv-events", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()

    # --- the loop ------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self.stopping.is_set():
            try:
                self._sync(self.endpoints())
                if not self._subs:
                    self.stopping.wait(POLL_MS / 1000)
                    continue
                self._receive()
            except Exception:  # noqa: BLE001 - the loop never dies
                log.exception("KV events: a pass failed")
                self.stopping.wait(1.0)
        for _, sock in self._subs.values():
            sock.close(linger=0)
        self._subs.clear()

    def _sync(self, endpoints: Sequence[EndpointInfo]) -> None:
        """Subscribe to the endpoints that publish, unsubscribe from those gone (or moved)."""
        wanted = {e.id: e for e in endpoints if e.kv_events}
        for eid in list(self._subs):
            addr, sock = self._subs[eid]
            if eid not in wanted or wanted[eid].kv_events != addr:
                sock.close(linger=0)
                del self._subs[eid]
                self._replay_at.pop(eid, None)
                self.index.forget(eid)
                self._observed(eid)
        if not wanted:
            return
        if self.tokenizers is not None:
            self.tokenizers.want({e.tokenizer for e in wanted.values() if e.tokenizer})
        if self._zmq is None:
            self._zmq = _zmq()
            self._ctx = self._zmq.Context()
        for eid, e in wanted.items():
            if eid in self._subs:
                continue
            sock = self._ctx.socket(self._zmq.SUB)
            sock.setsockopt(self._zmq.SUBSCRIBE, b"")
            sock.setsockopt(self._zmq.RCVHWM, 100_000)
            sock.connect(e.kv_events)
            self._subs[eid] = (e.kv_events, sock)
            self._replay_at[eid] = e.kv_replay
            self._observed(eid)  # -1: subscribed, nothing heard yet

    def _receive(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        by_sock = {}
        for eid, (_, sock) in self._subs.items():
            poller.register(sock, zmq.POLLIN)
            by_sock[sock] = eid
        for sock, _ in poller.poll(POLL_MS):
            eid = by_sock[sock]
            for _ in range(1000):  # drain what is there, then let the list be re-read
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._one(eid, frames)

    def _one(self, eid: str, frames: list[bytes]) -> None:
        try:
            batch = decode_message(frames)
        except WireError as e:
            if eid not in self._warned:
                self._warned.add(eid)
                log.warning("KV events from %s: %s (further bad messages are dropped quietly)", eid, e)
            return
        gap = self.index.apply(eid, batch)
        if gap is not None:
            self._replay(eid, gap)
        self._observed(eid)

    def _observed(self, eid: str) -> None:
        if self.observe is not None:
            self.observe(eid, *self.index.progress(eid))

    def _replay(self, eid: str, start: int) -> None:
        """Ask the endpoint's replay socket for every batch from `start` on; what it cannot give is
        counted as lost (`Index.gaps`) and routing goes on with the rest."""
        zmq, addr = self._zmq, self._replay_at.get(eid)
        got = 0
        if addr:
            sock = self._ctx.socket(zmq.DEALER)
            try:
                sock.connect(addr)
                sock.send_multipart(replay_request(start))
                while got < MAX_REPLAY and sock.poll(REPLAY_TIMEOUT_MS):
                    batch = decode_replay(sock.recv_multipart())
                    if batch is None:
                        break
                    got += 1
                    self.index.replayed(eid, batch)
            except (WireError, zmq.ZMQError) as e:
                log.warning("KV events replay from %s failed: %s", eid, e)
            finally:
                sock.close(linger=0)
        self.index.replay_done(eid)
