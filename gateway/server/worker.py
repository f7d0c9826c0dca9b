"""The gateway's gunicorn worker: gunicorn's gevent worker that accepts new connections in batches,
and, when told to stop, closes the connections that are only waiting for a next request.

Why batches: with more than one worker, gunicorn's gevent worker accepts one connection per turn of
the event loop (`max_accept = 1`, to spread connections over the workers). Under load a turn of the
loop serves every ready connection first, so it lasts tens of milliseconds, and a burst of new
connections waits in the listen queue meanwhile: at thousands of concurrent streams most clients
waited there for their first byte while the connections already accepted were served (`ss -ltn`
showed the queue; the tail of `python -m bench.streams --levels 4096`, docs/history.md).
Each worker now takes several pending connections per turn, as many as keep it level with its
least-loaded sibling (their open connection counts are in the sibling table, gateway.server.siblings)
plus ACCEPT_SLACK, at most ACCEPT_BATCH: a burst is taken in a few turns and still spread over the
workers. (A fixed batch let one worker take all 32 connections of a benchmark's client at once, its
sibling idle: `python -m bench.gateway` at concurrency 32.) A worker alone takes ACCEPT_BATCH.

Why: on SIGTERM gunicorn's gevent worker stops accepting, then waits until every connection of its
pool is gone, up to graceful_timeout (30 s). A connection kept alive between requests (the OpenAI SDK,
httpx, requests' sessions and every proxy keep them) counts as busy all that while, so a gateway with
one idle client took the whole graceful timeout to stop, and `docker stop` (10 s) killed it with its
open streams instead. Closing a connection that holds no request loses nothing: HTTP lets a server
close an idle keep-alive connection at any time and clients retry on a fresh one. A connection with a
request in progress is left to finish (gunicorn closes it after that response, as the worker is no
longer alive).
"""

from __future__ import annotations

import socket
from contextlib import contextmanager

import gevent
from gevent.server import StreamServer
from gunicorn.workers import ggevent
from gunicorn.workers.ggevent import GeventWorker

from gateway.server import siblings

# Connections a worker accepts per turn of its event loop, at most (gevent's own default is 100), and
# how many more than its least-loaded sibling holds it may take in one turn.
ACCEPT_BATCH = 64
ACCEPT_SLACK = 4

# How often, while stopping, connections that have just gone idle are closed too (a response that
# ends after the first sweep closes its connection itself; this covers one that went back to waiting
# in the instant the signal arrived).
_SWEEP_EVERY = 0.2


def accept_allowance(mine: int, fewest: int | None) -> int:
    """Connections a worker holding `mine` accepts in one turn, its least-loaded sibling holding
    `fewest` (None: it has none)."""
    if fewest is None:
        return ACCEPT_BATCH
    return max(1, min(ACCEPT_BATCH, fewest + ACCEPT_SLACK - mine))


class BatchAcceptServer(StreamServer):
    """gevent's StreamServer that takes `allowance()` connections per turn (gevent reads `max_accept`
    once per turn), whatever gunicorn sets (it sets 1 for several workers)."""

    allowance = staticmethod(lambda: ACCEPT_BATCH)  # set by the worker that runs it (its process's)
    max_accept = property(lambda self: self.allowance(), lambda self, value: None)


class GatewayWorker(GeventWorker):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Every open connection's client socket, and those of the ones now waiting for their next
        # request, by the greenlet that serves it (one greenlet per connection).
        self._clients: dict[object, socket.socket] = {}
        self._idle: dict[object, socket.socket] = {}

    def load_wsgi(self):
        # gunicorn makes the app now (`gateway:create_app()`, no arguments), after post_fork attached
        # this worker's row of the sibling table: the factory is handed the row as it builds the gateway.
        with siblings.handing(getattr(self, "llmgw_siblings", None)):
            super().load_wsgi()

    def run(self):
        # gunicorn builds its servers from this module name inside run(): in this worker process
        # only, after the fork.
        ggevent.StreamServer = BatchAcceptServer
        BatchAcceptServer.allowance = staticmethod(self._allowance)
        super().run()

    def _allowance(self) -> int:
        table = getattr(self, "llmgw_siblings", None)
        return accept_allowance(len(self._clients), table.fewest_connections() if table is not None else None)

    def _count(self) -> None:
        table = getattr(self, "llmgw_siblings", None)
        if table is not None:
            table.set_connections(len(self._clients))

    def handle(self, listener, client, addr):
        me = gevent.getcurrent()
        self._clients[me] = client
        self._count()
        try:
            super().handle(listener, client, addr)
        finally:
            self._clients.pop(me, None)
            self._idle.pop(me, None)
            self._count()

    @contextmanager
    def _waiting_for_a_request(self):
        me = gevent.getcurrent()
        client = self._idle[me] = self._clients[me]  # gunicorn enters this only inside handle()
        if not self.alive:
            _close_for_reading(client)
        try:
            with gevent.Timeout(self.cfg.keepalive, False):
                yield
        finally:
            self._idle.pop(me, None)

    def timeout_ctx(self):
        # gunicorn enters this only around reading the next request of a connection (base_async.handle).
        return self._waiting_for_a_request()

    def handle_exit(self, sig, frame):
        super().handle_exit(sig, frame)
        gevent.spawn(self._close_idle_while_stopping)

    def _close_idle_while_stopping(self):
        while True:
            for client in list(self._idle.values()):
                _close_for_reading(client)
            gevent.sleep(_SWEEP_EVERY)


def _close_for_reading(client: socket.socket) -> None:
    """The waiting read sees end of stream and gunicorn closes the connection as a client's leaving."""
    try:
        client.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed by the peer
