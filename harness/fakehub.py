"""A loopback Hugging Face hub: the parts of its HTTP API the real `huggingface_hub` client uses.

    hub = FakeHub().start()
    hub.add_repo("org/tiny", {"config.json": b"{...}", "model.safetensors": path_or_bytes})
    HfApi(endpoint=hub.endpoint).model_info("org/tiny", files_metadata=True)
    hub.stop()

Two listeners on 127.0.0.1, as the real hub has two origins: the hub (`endpoint`) answers
`GET /api/models/{repo}[/revision/{rev}]` (`?blobs=true`: sizes, blob ids, LFS sha256),
`GET /api/models/{repo}/tree/{rev}[/{path}]`, `POST /api/models/{repo}/paths-info/{rev}` and
`HEAD|GET /{repo}/resolve/{rev}/{path}`: a file stored in git is answered there (ETag = its git
blob sha1), an LFS file (.gguf, .safetensors, .bin, or over 10 MiB) by a 302 to the CDN listener
with `X-Linked-Etag` (its sha256), `X-Linked-Size` and `X-Repo-Commit`, so the client drops the token
there as it does for the real CDN. No `X-Xet-*` header is ever sent: the client takes plain HTTP.
The CDN listener also serves plain files for URL sources: `hub.file_url(name)` after `add_file`.

Every GET and HEAD honours `Range: bytes=N-` (206) and `If-Range`. `log` records each request
(method, path, range, status, body bytes sent, whether a token came) to prove a resume fetched only
the rest. Faults: `require_token` (401 without `Bearer <it>`, as a private repo), unknown repos,
revisions and files (404 with the hub's X-Error-Code), `private` (only those repositories need the
token), `cut_after[name] = N` (the next GET of that
file or blob is cut after N body bytes), `rate` (bytes per second, per response), `ignore_range`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import socket
import threading
from dataclasses import dataclass, field
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

LFS_SUFFIXES = (".gguf", ".safetensors", ".bin", ".pt", ".pth")
LFS_MIN = 10 * 1024 * 1024
CHUNK = 256 * 1024


@dataclass
class Blob:
    name: str
    data: bytes | Path
    size: int
    sha256: str
    git_sha1: str
    lfs: bool

    def read(self, start: int, end: int) -> bytes:
        if isinstance(self.data, bytes):
            return self.data[start:end]
        with open(self.data, "rb") as f:
            f.seek(start)
            return f.read(end - start)

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.git_sha1


def make_blob(name: str, data: bytes | Path, lfs: bool | None = None) -> Blob:
    if isinstance(data, Path):
        st = data.stat()
        return _file_blob(name, data, st.st_size, st.st_mtime_ns, lfs)
    return _make_blob(name, data, lfs)


@functools.lru_cache(maxsize=16)
def _file_blob(name: str, data: Path, size: int, mtime: int, lfs: bool | None) -> Blob:
    return _make_blob(name, data, lfs)  # a large file is hashed once per test session


def _make_blob(name: str, data: bytes | Path, lfs: bool | None) -> Blob:
    sha, size = hashlib.sha256(), 0
    if isinstance(data, bytes):
        sha.update(data)
        size = len(data)
        git = hashlib.sha1(b"blob %d\x00" % size + data).hexdigest()
    else:
        size = Path(data).stat().st_size
        g = hashlib.sha1(b"blob %d\x00" % size)
        with open(data, "rb") as f:
            while block := f.read(1 << 22):
                sha.update(block)
                g.update(block)
        git = g.hexdigest()
    is_lfs = lfs if lfs is not None else (name.lower().endswith(LFS_SUFFIXES) or size > LFS_MIN)
    return Blob(name, data, size, sha.hexdigest(), git, is_lfs)


@dataclass
class Repo:
    commits: dict[str, dict[str, Blob]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)

    def commit_for(self, rev: str) -> str | None:
        return self.refs.get(rev) or (rev if rev in self.commits else None)


class _Server(ThreadingHTTPServer):
    daemon_threads = False
    block_on_close = True

    def handle_error(self, request, client_address):
        pass  # a connection cut on purpose, or by the client: expected here


class FakeHub:
    def __init__(self, host: str = "127.0.0.1"):
        self.host = host
        self.repos: dict[str, Repo] = {}
        self.files: dict[str, Blob] = {}  # plain URL files, by name
        self.blobs: dict[str, Blob] = {}  # CDN, by sha256
        self.lock = threading.Lock()
        self.log: list[dict] = []
        self.require_token: str | None = None
        # With `require_token`: only these repositories need it (empty: every one does, a private hub).
        self.private: set[str] = set()
        self.cut_after: dict[str, int] = {}
        self.rate: float | None = None
        self.ignore_range = False
        self.stopping = threading.Event()
        self.conns: set[socket.socket] = set()
        self.hub = _Server((host, 0), self._handler("hub"))
        self.cdn = _Server((host, 0), self._handler("cdn"))
        self.threads: list[threading.Thread] = []

    # --- content ------------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.hub.server_address[1]}"

    @property
    def cdn_base(self) -> str:
        return f"http://{self.host}:{self.cdn.server_address[1]}"

    def add_repo(self, repo: str, files: dict[str, bytes | Path], revision: str = "main") -> str:
        """Commit `files` to `repo` and point `revision` at it; returns the commit sha."""
        blobs = {name: make_blob(name, data) for name, data in files.items()}
        digest = hashlib.sha1(json.dumps(sorted((n, b.etag) for n, b in blobs.items())).encode() + revision.encode())
        commit = digest.hexdigest()
        with self.lock:
            r = self.repos.setdefault(repo, Repo())
            r.commits[commit] = blobs
            r.refs[revision] = commit
            for b in blobs.values():
                if b.lfs:
                    self.blobs[b.sha256] = b
        return commit

    def add_file(self, name: str, data: bytes | Path) -> str:
        """A plain file for URL sources; returns its URL."""
        b = make_blob(name, data, lfs=False)
        with self.lock:
            self.files[name] = b
        return self.file_url(name)

    def file_url(self, name: str) -> str:
        return f"{self.cdn_base}/files/{quote(name)}"

    def sha256(self, name: str) -> str:
        return self.files[name].sha256

    # --- observation --------------------------------------------------------------------------
    def requests(self, method: str | None = None, contains: str = "") -> list[dict]:
        with self.lock:
            return [e for e in self.log if (method is None or e["method"] == method) and contains in e["path"]]

    def body_bytes(self, contains: str) -> int:
        """Body bytes sent by GETs whose path contains `contains` (a blob's sha256, a file name)."""
        return sum(e["sent"] for e in self.requests("GET", contains))

    # --- lifecycle ----------------------------------------------------------------------------
    def start(self) -> "FakeHub":
        for srv in (self.hub, self.cdn):
            t = threading.Thread(target=srv.serve_forever, args=(0.05,), name="fakehub", daemon=True)
            t.start()
            self.threads.append(t)
        return self

    def stop(self) -> None:
        self.stopping.set()
        for srv in (self.hub, self.cdn):
            srv.shutdown()
        for t in self.threads:
            t.join()
        with self.lock:
            conns = list(self.conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for srv in (self.hub, self.cdn):
            srv.server_close()

    def __enter__(self) -> "FakeHub":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- the handler --------------------------------------------------------------------------
    def _handler(self, role: str):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def setup(self):
                super().setup()
                with fake.lock:
                    fake.conns.add(self.connection)

            def finish(self):
                try:
                    super().finish()
                finally:
                    with fake.lock:
                        fake.conns.discard(self.connection)

            def do_HEAD(self):
                self._route(head=True)

            def do_GET(self):
                self._route(head=False)

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                self._body = self.rfile.read(n) if n else b""
                self._route(head=False)

            # -- routing
            def _route(self, head: bool):
                self._entry = {"method": self.command, "path": self.path, "range": self.headers.get("Range"),
                               "auth": self.headers.get("Authorization") is not None, "status": 0, "sent": 0}
                with fake.lock:
                    fake.log.append(self._entry)
                path = urlsplit(self.path).path
                try:
                    if role == "cdn":
                        return self._cdn(path, head)
                    if not self._authorised(path):
                        return
                    if path.startswith("/api/models/"):
                        return self._api(path[len("/api/models/"):])
                    parts = path.strip("/").split("/")
                    if len(parts) >= 5 and parts[2] == "resolve":
                        return self._resolve("/".join(parts[:2]), unquote(parts[3]), unquote("/".join(parts[4:])), head)
                    self._error(404, "EntryNotFound", "no such path")
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True

            def _authorised(self, path: str) -> bool:
                want = fake.require_token
                parts = path.removeprefix("/api/models/").strip("/").split("/")
                if want is None or (fake.private and "/".join(parts[:2]) not in fake.private):
                    return True
                got = self.headers.get("Authorization")
                if got == f"Bearer {want}":
                    return True
                if got is None:  # what the hub says of a private repo to an anonymous client
                    self._error(401, "RepoNotFound", "Invalid username or password.")
                else:
                    self._error(401, None, "Invalid credentials in Authorization header")
                return False

            def _repo(self, repo: str, rev: str):
                r = fake.repos.get(repo)
                if r is None:
                    self._error(404, "RepoNotFound", "Repository not found")
                    return None, None
                commit = r.commit_for(rev)
                if commit is None:
                    self._error(404, "RevisionNotFound", "Invalid rev id: " + rev)
                    return None, None
                return commit, r.commits[commit]

            # -- the API
            def _api(self, rest: str):
                q = parse_qs(urlsplit(self.path).query)
                parts = rest.split("/")
                repo = "/".join(parts[:2])
                tail = parts[2:]
                if not tail or tail[0] == "revision":
                    rev = unquote(tail[1]) if len(tail) > 1 else "main"
                    commit, files = self._repo(repo, rev)
                    if commit is None:
                        return
                    blobs = q.get("blobs", ["false"])[0].lower() == "true"
                    siblings = [self._sibling(n, b, blobs) for n, b in sorted(files.items())]
                    return self._json({"id": repo, "modelId": repo, "sha": commit, "private": fake.require_token is not None,
                                       "siblings": siblings, "tags": [], "downloads": 0, "likes": 0})
                if tail[0] == "tree":
                    commit, files = self._repo(repo, unquote(tail[1]) if len(tail) > 1 else "main")
                    if commit is None:
                        return
                    prefix = unquote("/".join(tail[2:]))
                    recursive = q.get("recursive", ["false"])[0].lower() == "true"
                    return self._json(self._tree(files, prefix, recursive))
                if tail[0] == "paths-info" and self.command == "POST":
                    commit, files = self._repo(repo, unquote(tail[1]) if len(tail) > 1 else "main")
                    if commit is None:
                        return
                    wanted = parse_qs(getattr(self, "_body", b"").decode()).get("paths", [])
                    return self._json([self._file_entry(p, files[p]) for p in wanted if p in files])
                self._error(404, None, "unknown API path")

            @staticmethod
            def _sibling(name: str, b: Blob, blobs: bool) -> dict:
                if not blobs:
                    return {"rfilename": name}
                d = {"rfilename": name, "size": b.size, "blobId": b.git_sha1}
                if b.lfs:
                    d["size"] = b.size
                    d["lfs"] = {"size": b.size, "sha256": b.sha256, "pointerSize": 134}
                return d

            @staticmethod
            def _file_entry(name: str, b: Blob) -> dict:
                d = {"type": "file", "oid": b.git_sha1, "size": b.size, "path": name}
                if b.lfs:
                    d["lfs"] = {"oid": b.sha256, "size": b.size, "pointerSize": 134}
                return d

            def _tree(self, files: dict[str, Blob], prefix: str, recursive: bool) -> list[dict]:
                out, dirs = [], set()
                base = prefix.rstrip("/") + "/" if prefix else ""
                for name, b in sorted(files.items()):
                    if not name.startswith(base):
                        continue
                    rest = name[len(base):]
                    if "/" in rest and not recursive:
                        dirs.add(base + rest.split("/")[0])
                        continue
                    out.append(self._file_entry(name, b))
                out += [{"type": "directory", "oid": "0" * 40, "size": 0, "path": d} for d in sorted(dirs)]
                return out

            def _resolve(self, repo: str, rev: str, name: str, head: bool):
                commit, files = self._repo(repo, rev)
                if commit is None:
                    return
                b = files.get(name)
                if b is None:
                    return self._error(404, "EntryNotFound", f"{name} does not exist", commit=commit)
                common = {"X-Repo-Commit": commit}
                if b.lfs:
                    self._entry["status"] = 302
                    self.send_response(302)
                    for k, v in {**common, "Location": f"{fake.cdn_base}/blobs/{b.sha256}",
                                 "X-Linked-Etag": f'"{b.sha256}"', "X-Linked-Size": str(b.size),
                                 "ETag": f'"{b.git_sha1}"', "Content-Length": "0"}.items():
                        self.send_header(k, v)
                    self.end_headers()
                    return
                self._serve(b, head, {**common, "ETag": f'"{b.git_sha1}"'}, key=name)

            # -- the CDN and plain files
            def _cdn(self, path: str, head: bool):
                if path.startswith("/blobs/"):
                    b = fake.blobs.get(path[len("/blobs/"):])
                    if b is None:
                        return self._error(404, None, "no such blob")
                    return self._serve(b, head, {"ETag": f'"{b.sha256}"'}, key=b.sha256)
                if path.startswith("/files/"):
                    name = unquote(path[len("/files/"):])
                    b = fake.files.get(name)
                    if b is None:
                        return self._error(404, None, "no such file")
                    return self._serve(b, head, {"ETag": f'"{b.sha256}"',
                                                 "Last-Modified": formatdate(0, usegmt=True)}, key=name)
                self._error(404, None, "no such path")

            def _serve(self, b: Blob, head: bool, headers: dict[str, str], key: str):
                start, end, status = 0, b.size, 200
                rng = self.headers.get("Range")
                if_range = self.headers.get("If-Range")
                if rng and not fake.ignore_range and (if_range is None or if_range == headers.get("ETag")
                                                      or if_range == headers.get("Last-Modified")):
                    try:
                        spec = rng.split("=", 1)[1]
                        lo, _, hi = spec.partition("-")
                        start = int(lo)
                        end = min(int(hi) + 1, b.size) if hi else b.size
                    except (IndexError, ValueError):
                        return self._error(400, None, "bad range")
                    if start >= b.size:
                        self._entry["status"] = 416
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{b.size}")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    status = 206
                self._entry["status"] = status
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Length", str(end - start))
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{end - 1}/{b.size}")
                self.end_headers()
                if head:
                    return
                with fake.lock:
                    cut = fake.cut_after.pop(key, None)
                pos = start
                while pos < end and not fake.stopping.is_set():
                    n = min(CHUNK, end - pos)
                    if cut is not None:
                        n = min(n, cut - self._entry["sent"])
                        if n <= 0:
                            self.close_connection = True
                            self.connection.shutdown(socket.SHUT_RDWR)
                            return
                    self.wfile.write(b.read(pos, pos + n))
                    pos += n
                    self._entry["sent"] += n
                    if fake.rate:
                        fake.stopping.wait(n / fake.rate)

            def _json(self, body):
                data = json.dumps(body).encode()
                self._entry["status"] = 200
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _error(self, status: int, code: str | None, message: str, commit: str | None = None):
                data = json.dumps({"error": message}).encode()
                self._entry["status"] = status
                self.send_response(status)
                if code:
                    self.send_header("X-Error-Code", code)
                self.send_header("X-Error-Message", message)
                if commit:
                    self.send_header("X-Repo-Commit", commit)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

        return Handler


def tiny_model_files(layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2, vocab: int = 256,
                     ff: int = 128, dtype: str = "BF16") -> dict[str, bytes]:
    """A small Llama-shaped Hugging Face model: config.json and model.safetensors (zeros), written here
    so a test knows every number in it."""
    size = {"BF16": 2, "F16": 2, "F32": 4}[dtype]
    head_dim = hidden // heads
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden),
              "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (hidden, hidden),
                       p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
                       p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
                       p + "self_attn.o_proj.weight": (hidden, hidden),
                       p + "mlp.gate_proj.weight": (ff, hidden), p + "mlp.up_proj.weight": (ff, hidden),
                       p + "mlp.down_proj.weight": (hidden, ff),
                       p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,)})
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in shapes.items():
        n = size
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    blob = len(raw).to_bytes(8, "little") + raw + bytes(offset)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
              "intermediate_size": ff, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "vocab_size": vocab, "max_position_embeddings": 4096,
              "torch_dtype": {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}[dtype]}
    return {"config.json": json.dumps(config, indent=2).encode(), "model.safetensors": blob,
            "tokenizer.json": b'{"version": "1.0"}', "generation_config.json": b"{}"}


def main(argv: list[str] | None = None) -> None:
    """`python -m harness.fakehub FILE...`: serve each file as a plain URL and as the only file
    of the repository `bench/<its name>`; print {"endpoint", "urls"} as one JSON line; stop on SIGTERM."""
    import argparse
    import signal
    import sys

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("files", nargs="+", type=Path)
    args = ap.parse_args(argv)
    hub = FakeHub().start()
    urls = {}
    for f in args.files:
        urls[f.name] = hub.add_file(f.name, f)
        hub.add_repo(f"bench/{f.stem}", {f.name: f})
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    print(json.dumps({"endpoint": hub.endpoint, "urls": urls}), flush=True)
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    hub.stop()
    sys.exit(0)


if __name__ == "__main__":
    main()
