"""The gateway's gunicorn worker: gunicorn's gevent worker that accepts new connections in batches,
and, when told to stop, closes the connections that are only waiting for a next request.

Why batches: with more than one worker, gunicorn's gevent worker accepts one connection per turn of
the event loop (`max_accept = 1`, to spread connections over the workers). Under load a turn of the
loop serves every ready connection first, so it lasts tens of milliseconds, and a burst of new
connections waits in the listen queue meanwhile: at 4,096 concurrent streams most clients waited
there tens of seconds for their first byte while the connections already accepted were served
(`ss -ltn` showed ~3,000 connections queued for 15 s; the tail the 4,096-stream benchmark saw).
Each worker now takes up to ACCEPT_BATCH pending connections per turn; both workers are woken by
the same listening socket, so a burst is still shared between them.

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

# Connections a worker accepts per turn of its event loop (gevent's own default is 100).
ACCEPT_BATCH = 64

# How often, while stopping, connections that have just gone idle are closed too (a response that
# ends after the first sweep closes its connection itself; this covers one that went back to waiting
# in the instant the signal arrived).
_SWEEP_EVERY = 0.2


class BatchAcceptServer(StreamServer):
    """gevent's StreamServer that keeps taking up to ACCEPT_BATCH connections per turn, whatever
    gunicorn sets (it sets 1 for several workers)."""

    max_accept = property(lambda self: ACCEPT_BATCH, lambda self, value: None)


class GatewayWorker(GeventWorker):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Every open connection's client socket, and those of the ones now waiting for their next
        # request, by the greenlet that serves it (one greenlet per connection).
        self._clients: dict[object, socket.socket] = {}
        self._idle: dict[object, socket.socket] = {}

    def run(self):
        # gunicorn builds its servers from this module name inside run(): in this worker process
        # only, after the fork.
        ggevent.StreamServer = BatchAcceptServer
        super().run()

    def handle(self, listener, client, addr):
        me = gevent.getcurrent()
        self._clients[me] = client
        try:
            super().handle(listener, client, addr)
        finally:
            self._clients.pop(me, None)
            self._idle.pop(me, None)

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
