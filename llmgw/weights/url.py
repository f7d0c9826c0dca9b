"""One file over HTTP into `<name>.incomplete`, resumed with `Range: bytes=N-`, verified, then renamed.

Bytes already on disk are never fetched again: a partial file left by a kill or a broken connection is
continued from its length (the server must answer 206 from that offset; a 200 means it ignored the
range or the file changed under `If-Range`, and the partial is started over). The digest (sha256, or
the hub's git-sha1 for small files) is computed as the bytes arrive, the partial's own bytes first on
a resume, so a finished file needs no second read; a mismatch removes the partial. Only a verified
file is renamed to its final name, so a half-written file is never taken for complete.
"""

from __future__ import annotations

import errno
import hashlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import requests

from llmgw.weights.errors import DownloadFailed

CHUNK = 1 << 20
CONNECT_TIMEOUT, READ_TIMEOUT = 10.0, 60.0
# Retries of a transient failure (connection cut, read timeout, 5xx) within one attempt; reset
# whenever bytes arrived, so a long download over a flaky link goes on as long as it moves.
RETRIES = 5


@dataclass(frozen=True)
class Digest:
    """What the finished file must hash to: `algo` is sha256 (LFS files, #sha256=) or git-sha1 (the
    hub's ETag of a file stored in git: sha1 over `blob <size>\\0` and the bytes)."""

    algo: str
    hexdigest: str

    def hasher(self, size: int | None):
        h = hashlib.sha1() if self.algo == "git-sha1" else hashlib.sha256()
        if self.algo == "git-sha1":
            h.update(b"blob %d\x00" % (size or 0))
        return h


@dataclass(frozen=True)
class Head:
    size: int | None
    etag: str | None
    last_modified: str | None


def digest_for_etag(etag: str) -> Digest | None:
    """The hub's ETag as a checksum: 64 hex digits are an LFS file's sha256, 40 a git blob's sha1."""
    e = etag.strip('"').removeprefix("W/").strip('"').lower()
    if len(e) == 64 and all(c in "0123456789abcdef" for c in e):
        return Digest("sha256", e)
    if len(e) == 40 and all(c in "0123456789abcdef" for c in e):
        return Digest("git-sha1", e)
    return None


def http_failure(source: str, status: int, url: str, token_sent: bool) -> DownloadFailed:
    """A non-success status as a reason a user can act on."""
    if status == 401:
        if token_sent:
            return DownloadFailed(source, "auth", "the server refused the token (HF_TOKEN): it is invalid or "
                                                  "has no access (HTTP 401)")
        return DownloadFailed(source, "auth", "the server asks for credentials (HTTP 401): set HF_TOKEN in "
                                              "the node agent's environment")
    if status == 403:
        return DownloadFailed(source, "auth", "the server refused access (HTTP 403): the token (HF_TOKEN) "
                                              "has no access, or the repository's terms are not accepted")
    if status == 404:
        return DownloadFailed(source, "not_found", f"not found (HTTP 404): {url}")
    retry = status in (408, 425, 429) or status >= 500
    return DownloadFailed(source, "server", f"the server answered HTTP {status} for {url}", retryable=retry)


def head(session: requests.Session, url: str, headers: dict[str, str], source: str) -> Head:
    """Size and validators of a plain URL (following redirects); a server without HEAD gives Nones."""
    try:
        r = session.head(url, headers={**headers, "Accept-Encoding": "identity"}, allow_redirects=True,
                         timeout=(CONNECT_TIMEOUT, READ_TIMEOUT))
    except requests.RequestException as e:
        raise DownloadFailed(source, "connection", f"cannot reach {url}: {_short(e)}", retryable=True) from e
    if r.status_code in (405, 501):
        return Head(None, None, None)
    if r.status_code >= 400:
        raise http_failure(source, r.status_code, url, "authorization" in {k.lower() for k in headers})
    size = r.headers.get("Content-Length")
    return Head(int(size) if size and size.isdigit() else None, r.headers.get("ETag"), r.headers.get("Last-Modified"))


def fetch(session: requests.Session, url: str, final: Path, *, source: str, size: int | None,
          digest: Digest | None = None, headers: dict[str, str] | None = None, if_range: str | None = None,
          on_bytes: Callable[[int], None] = lambda n: None, cancel: threading.Event | None = None,
          sleep: Callable[[float], object] = lambda s: None,
          on_verify: Callable[[], None] = lambda: None) -> int:
    """Make `final` the complete, verified file at `url`; returns the bytes fetched by this call.

    The caller holds the lock for `final`. `size` (when known) bounds the partial; `if_range` (an
    ETag or Last-Modified) makes the server restart from 0 if the file changed since the partial began."""
    partial = final.with_name(final.name + ".incomplete")
    final.parent.mkdir(parents=True, exist_ok=True)
    fetched, tries = 0, 0
    running = _Running(digest, size) if digest is not None else None
    while True:
        try:
            fetched += _one_pass(session, url, partial, source=source, size=size, headers=headers or {},
                                 if_range=if_range, on_bytes=on_bytes, cancel=cancel, running=running)
            break
        except _Transient as t:
            fetched += t.fetched
            tries = 0 if t.fetched else tries + 1
            if tries >= RETRIES:
                raise t.failure from None
            sleep(min(2.0 ** tries, 10.0))
    got = partial.stat().st_size
    if size is not None and got != size:
        raise DownloadFailed(source, "connection", f"the server sent {got} bytes of {size}", retryable=True)
    if digest is not None:
        on_verify()
        running.cover(partial, got)
        actual = running.h.hexdigest()
        if actual != digest.hexdigest:
            partial.unlink(missing_ok=True)
            raise DownloadFailed(source, "checksum", f"checksum mismatch for {final.name}: expected {digest.algo} "
                                                     f"{digest.hexdigest}, got {actual} (the partial file was "
                                                     "removed; the next attempt fetches it again)", retryable=True)
    os.replace(partial, final)
    return fetched


class _Transient(Exception):
    def __init__(self, failure: DownloadFailed, fetched: int):
        self.failure, self.fetched = failure, fetched


class _Running:
    """A digest kept up to date with the partial file: `cover(partial, n)` makes it cover exactly the
    first n bytes (re-reading them from disk only when it does not already)."""

    def __init__(self, digest: Digest, size: int | None):
        self.digest, self.size = digest, size
        self.h, self.n = None, -1

    def cover(self, partial: Path, n: int) -> None:
        if self.h is not None and self.n == n:
            return
        self.h, self.n = self.digest.hasher(self.size), 0
        if n:
            with open(partial, "rb") as f:
                while self.n < n and (block := f.read(min(8 * CHUNK, n - self.n))):
                    self.update(block)

    def update(self, chunk: bytes) -> None:
        self.h.update(chunk)
        self.n += len(chunk)


def _one_pass(session, url, partial: Path, *, source, size, headers, if_range, on_bytes, cancel,
              running: _Running | None) -> int:
    offset = partial.stat().st_size if partial.exists() else 0
    if size is not None and offset > size:
        partial.unlink()
        offset = 0
    if size is not None and offset == size:
        return 0
    req = dict(headers)
    req["Accept-Encoding"] = "identity"  # a compressed body would not line up with byte offsets
    if offset:
        req["Range"] = f"bytes={offset}-"
        if if_range:
            req["If-Range"] = if_range
    try:
        r = session.get(url, headers=req, stream=True, allow_redirects=True, timeout=(CONNECT_TIMEOUT, READ_TIMEOUT))
    except requests.RequestException as e:
        raise _Transient(DownloadFailed(source, "connection", f"cannot reach {url}: {_short(e)}", retryable=True), 0) from e
    with r:
        if r.status_code == 416 and offset:
            partial.unlink()  # the partial is longer than the file now is: start over
            raise _Transient(DownloadFailed(source, "server", "the server refused the resume range", retryable=True), 0)
        if r.status_code >= 400:
            failure = http_failure(source, r.status_code, url, "authorization" in {k.lower() for k in headers})
            if failure.retryable:
                raise _Transient(failure, 0)
            raise failure
        if offset and r.status_code == 206 and not _range_starts_at(r.headers.get("Content-Range", ""), offset):
            raise DownloadFailed(source, "server", f"the server answered a resume at byte {offset} with "
                                                   f"Content-Range {r.headers.get('Content-Range')!r}")
        mode = "ab" if offset and r.status_code == 206 else "wb"  # 200: the whole file, from byte 0
        if running is not None:
            running.cover(partial, offset if mode == "ab" else 0)
        return _write_body(r, partial, mode, source=source, on_bytes=on_bytes, cancel=cancel, running=running)


def _write_body(r, partial: Path, mode: str, *, source, on_bytes, cancel, running: _Running | None) -> int:
    fetched = 0
    try:
        with open(partial, mode) as f:
            for chunk in r.iter_content(CHUNK):
                if cancel is not None and cancel.is_set():
                    raise DownloadFailed(source, "cancelled", "the download was cancelled")
                if chunk:
                    f.write(chunk)
                    if running is not None:
                        running.update(chunk)
                    fetched += len(chunk)
                    on_bytes(len(chunk))
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DownloadFailed(source, "disk_full", f"the disk under {partial.parent} is full "
                                                      f"({partial.stat().st_size} bytes of it kept for the "
                                                      "next attempt)") from e
        if isinstance(e, requests.RequestException):  # requests' errors are OSErrors too
            raise _Transient(DownloadFailed(source, "connection", f"the connection broke: {_short(e)}",
                                            retryable=True), fetched) from e
        raise DownloadFailed(source, "disk", f"cannot write {partial}: {e.strerror or e}") from e
    return fetched


def _range_starts_at(content_range: str, offset: int) -> bool:
    # "bytes 100-199/200"
    try:
        return int(content_range.split()[1].split("-")[0]) == offset
    except (IndexError, ValueError):
        return False


def _short(e: BaseException) -> str:
    text = str(e)
    return text if len(text) <= 200 else text[:200] + "..."
