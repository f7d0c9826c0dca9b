"""The SSE pass-through: chunks go out as they come, and the upstream is closed (or released to the
pool) in `finally` exactly once, whether the stream ended or the client went away. Response heads the
client refuses. (The client on real sockets: tests/integration/test_gateway_upstream.py.)"""

import pytest

from gateway.upstream.client import HOP_BY_HOP, Malformed, parse_head
from gateway.upstream.stream import StreamBody, sse_usage, stream_body, usage_from_json


class FakeResp:
    chunked = True

    def __init__(self, chunks, fail_after=None):
        self.data = chunks
        self.fail_after = fail_after
        self.closed = self.released = 0

    def chunks(self):
        for i, c in enumerate(self.data):
            if self.fail_after is not None and i == self.fail_after:
                raise OSError("connection reset")
            yield c

    def close(self):
        self.closed += 1

    def release(self):
        self.released += 1


def run(resp, take=None):
    done, first = [], []
    gen = stream_body(resp, deadline=1e18, on_first=lambda: first.append(1),
                      on_done=lambda ok, usage: done.append((ok, usage)))
    out = []
    for chunk in gen:
        out.append(chunk)
        if take is not None and len(out) == take:
            gen.close()  # what the WSGI server does when the client disconnects
            break
    return out, done, first


def test_stream_completes_and_releases_connection():
    usage = b'data: {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 7}}\n\n'
    resp = FakeResp([b"data: {\"a\": 1}\n\n", b"data: {\"b\": 2}\n\n", usage, b"data: [DONE]\n\n"])
    out, done, first = run(resp)
    assert len(out) == 4 and first == [1]
    assert done == [(True, (5, 7))]
    assert resp.released == 1 and resp.closed == 0


def test_client_disconnect_closes_upstream_once():
    resp = FakeResp([b"data: 1\n\n"] * 10)
    out, done, _ = run(resp, take=2)
    assert len(out) == 2
    assert resp.closed == 1 and resp.released == 0
    assert done == [(False, None)]


def test_upstream_breaking_mid_stream_ends_cleanly():
    resp = FakeResp([b"data: 1\n\n"] * 5, fail_after=2)
    out, done, _ = run(resp)
    assert len(out) == 2 and done == [(False, None)] and resp.closed == 1


def test_usage_split_across_the_last_two_chunks():
    line = b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 9}}\n\n'
    resp = FakeResp([b"data: {}\n\n" * 3, b"data: {}\n\n" + line[:20], line[20:] + b"data: [DONE]\n\n"])
    _, done, _ = run(resp)
    assert done == [(True, (3, 9))]
    assert sse_usage(line + b"data: [DONE]\n\n") == (3, 9)
    assert sse_usage(b'data: {"usage": null}\n\n') is None and sse_usage(b"data: [DONE]\n\n") is None
    assert sse_usage(b'data: {"usage": {"prompt_tokens": 0, "completion_tokens": 0}}') is None


def test_only_the_tail_is_scanned_for_usage():
    """An early chunk that mentions usage (an engine reporting it per chunk) does not count: only the
    stream's last event does."""
    early = b'data: {"usage": {"prompt_tokens": 1, "completion_tokens": 1}}\n\n'
    final = b'data: {"usage": {"prompt_tokens": 5, "completion_tokens": 8}}\n\n'
    _, done, _ = run(FakeResp([early, b"data: {}\n\n", b"data: {}\n\n", final, b"data: [DONE]\n\n"]))
    assert done == [(True, (5, 8))]


def test_usage_from_json():
    assert usage_from_json(b'{"usage": {"prompt_tokens": 2, "completion_tokens": 4}}') == (2, 4)
    assert usage_from_json(b'{"x": 1}') is None
    assert usage_from_json(b'not json "usage"') is None
    # An engine's answer nested deeper than the parser recurses: no usage, not a 500.
    assert usage_from_json(b'{"usage": ' + b"[" * 100_000 + b"]" * 100_000 + b"}") is None


def test_hop_by_hop_set():
    for h in ("connection", "transfer-encoding", "keep-alive", "upgrade", "te", "trailer"):
        assert h in HOP_BY_HOP


def test_body_never_iterated_still_closes_upstream():
    resp = FakeResp([b"data: 1\n\n"] * 3)
    done = []
    body = StreamBody(resp, 1e18, lambda: None, lambda ok, usage: done.append(ok))
    body.close()
    assert done == [False] and resp.closed == 1


def test_body_close_after_full_stream_does_not_double_count():
    resp = FakeResp([b"data: 1\n\n"] * 3)
    done = []
    body = StreamBody(resp, 1e18, lambda: None, lambda ok, usage: done.append(ok))
    assert len(list(body)) == 3
    body.close()
    assert done == [True] and resp.released == 1 and resp.closed == 0


@pytest.mark.parametrize("head", [b"SPDY/3 200 OK", b"HTTP/1.1 2x0 OK", b"HTTP/1.1 200 OK\r\nno colon here"])
def test_malformed_heads(head):
    with pytest.raises(Malformed):
        parse_head(head)
