"""The downloader's pure parts and seams: rate and ETA, ETag checksums, HTTP reasons, the file lock."""

from __future__ import annotations

import hashlib
import threading

import pytest

from llmgw.weights import lock
from llmgw.weights.download import Meter, Progress
from llmgw.weights.url import Digest, digest_for_etag, http_failure


def test_meter_rate_and_eta_over_a_window():
    m = Meter(window=10.0)
    assert m.sample(0.0, 0, 1000) == (None, None)
    assert m.sample(2.0, 200, 1000) == (100.0, 8.0)
    m.sample(12.0, 1200, 3000)
    rate, eta = m.sample(14.0, 1400, 3000)  # the samples before t=4 have left the window
    assert rate == pytest.approx(100.0) and eta == pytest.approx(16.0)
    assert Meter().sample(1.0, 5, None)[1] is None  # no total: no ETA


def test_progress_fraction():
    assert Progress("s", "downloading", 25, 100).fraction == 0.25 and Progress("s", "resolving").fraction is None


def test_etags_as_checksums():
    data = b"hello\n"
    git = hashlib.sha1(b"blob 6\x00" + data).hexdigest()
    d = digest_for_etag(f'"{git}"')
    assert d == Digest("git-sha1", git)
    h = d.hasher(len(data))
    h.update(data)
    assert h.hexdigest() == git  # what `git hash-object` gives, as the hub's ETag of a small file
    sha = hashlib.sha256(data).hexdigest()
    assert digest_for_etag(f'W/"{sha.upper()}"') == Digest("sha256", sha)
    assert digest_for_etag('"abc-123"') is None


@pytest.mark.parametrize("status,token,kind,needle,retry", [
    (401, False, "auth", "set HF_TOKEN in the node agent's environment", False),
    (401, True, "auth", "refused the token (HF_TOKEN)", False),
    (403, True, "auth", "HTTP 403", False),
    (404, False, "not_found", "not found (HTTP 404): http://h/x", False),
    (503, False, "server", "HTTP 503", True),
    (429, False, "server", "HTTP 429", True),
    (410, False, "server", "HTTP 410", False),
])
def test_http_failures(status, token, kind, needle, retry):
    f = http_failure("src", status, "http://h/x", token)
    assert (f.kind, f.retryable) == (kind, retry) and needle in f.reason


def test_the_lock_excludes_another_open_file_even_in_one_process(tmp_path):
    p = tmp_path / "locks" / "x.lock"
    fd = lock.try_lock(p)
    assert fd is not None
    assert lock.try_lock(p) is None  # a second open file description (another thread, another agent)
    lock.release(fd)
    fd2 = lock.try_lock(p)
    assert fd2 is not None
    lock.release(fd2)
    assert p.exists()  # never removed: waiters and holder lock one inode


def test_a_waiter_reports_while_it_waits_and_can_be_cancelled(tmp_path):
    p = tmp_path / "x.lock"
    fd = lock.try_lock(p)
    cancel, waits = threading.Event(), []

    def on_wait():
        waits.append(1)
        if len(waits) == 3:
            cancel.set()

    with pytest.raises(lock.Cancelled):
        with lock.held(p, cancel=cancel, on_wait=on_wait, poll=0.001):
            pass
    assert len(waits) == 3
    lock.release(fd)
    with lock.held(p, poll=0.001):
        assert lock.try_lock(p) is None
    fd = lock.try_lock(p)
    assert fd is not None
    lock.release(fd)
