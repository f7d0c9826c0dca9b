"""Hugging Face sources: resolve with huggingface_hub, lay files out in its cache layout.

One call resolves a source: `HfApi.model_info(repo, revision=REF, files_metadata=True)`
(`GET {endpoint}/api/models/{repo}/revision/{ref}?blobs=True`) gives the commit and every file's size
and blob id, and for an LFS file its sha256, which is also the ETag `hf_hub_download` names the blob
by. The bytes are then fetched by `llmgw.weights.url` from `hf_hub_url(..., revision=commit)`
(the hub redirects LFS files to its CDN; the token is not sent off the hub), into
`blobs/<etag>.incomplete` under the blob's own lock `.locks/models--ORG--REPO/<etag>.lock`, and
linked as `snapshots/<commit>/<path>` -> `../../blobs/<etag>` with `refs/<ref>` = commit: exactly
what huggingface_hub writes, so `hf_hub_download(..., local_files_only=True)` and vLLM's own loader
find the files. huggingface_hub 2.x's own download writes to a per-process `<etag>.<uuid>.incomplete`
and deletes it on failure, so it resumes a broken connection within one call but never after a kill;
that is why the GET is ours.

HF_ENDPOINT, HF_TOKEN and HF_HUB_OFFLINE are read from the environment handed in (the agent's), and
passed explicitly: the library reads its own copies once at import. The token is never written anywhere.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from llmgw.weights.errors import DownloadFailed
from llmgw.weights.sources import HubSource, select_gguf, select_repo_files
from llmgw.weights.url import Digest, digest_for_etag

DEFAULT_ENDPOINT = "https://huggingface.co"


@dataclass(frozen=True)
class HubFile:
    path: str  # inside the repository
    size: int
    etag: str  # the blob's name: LFS sha256, else the git blob id
    url: str


@dataclass(frozen=True)
class HubPlan:
    source: HubSource
    commit: str
    files: tuple[HubFile, ...]
    storage: Path  # <hub cache>/models--ORG--REPO

    @property
    def total(self) -> int:
        return sum(f.size for f in self.files)

    def blob(self, f: HubFile) -> Path:
        return self.storage / "blobs" / f.etag

    def lock(self, f: HubFile, hub_cache: Path) -> Path:
        return hub_cache / ".locks" / self.storage.name / f"{f.etag}.lock"

    def link(self, f: HubFile) -> Path:
        return self.storage / "snapshots" / self.commit / f.path

    def digest(self, f: HubFile) -> Digest | None:
        return digest_for_etag(f.etag)


@dataclass(frozen=True)
class HubEnv:
    endpoint: str
    token: str | None
    offline: bool

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> "HubEnv":
        offline = environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
        return cls(endpoint=(environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/"),
                   token=environ.get("HF_TOKEN") or None, offline=offline)

    def headers(self) -> dict[str, str]:
        from huggingface_hub.utils import build_hf_headers

        # token=False: never the token file of whoever runs the agent, only HF_TOKEN.
        return build_hf_headers(token=self.token or False, library_name="llmgw")


def storage_dir(hub_cache: Path, repo: str) -> Path:
    return hub_cache / ("models--" + repo.replace("/", "--"))


def resolve(source: HubSource, engine: str, hub_cache: Path, env: HubEnv) -> HubPlan:
    """The commit and files `source` names for `engine`, from one model-info call."""
    if env.offline:
        raise DownloadFailed(str(source), "offline", "HF_HUB_OFFLINE is set and the source is not in the "
                                                     "node's cache")
    from huggingface_hub import HfApi, hf_hub_url

    try:
        info = HfApi(endpoint=env.endpoint, token=env.token or False, library_name="llmgw").model_info(
            source.repo, revision=source.ref, files_metadata=True, timeout=30)
    except Exception as e:  # noqa: BLE001 - mapped to one reason below; anything else is re-raised there
        raise hub_failure(source, e, env) from e
    if not info.sha:
        raise DownloadFailed(str(source), "server", f"{env.endpoint} sent no commit for {source.repo}@{source.ref}")
    siblings = {s.rfilename: s for s in (info.siblings or [])}
    if engine == "llamacpp":
        wanted = select_gguf(source, siblings)
    elif source.path:
        wanted = select_gguf(source, siblings) if source.path.lower().endswith(".gguf") else (
            tuple(f for f in siblings if f == source.path) or _missing(source))
    else:
        wanted = select_repo_files(siblings)
    files = []
    for name in wanted:
        s = siblings[name]
        etag = (s.lfs.sha256 if s.lfs else None) or s.blob_id
        size = s.lfs.size if s.lfs else s.size
        if not etag or size is None:
            raise DownloadFailed(str(source), "server", f"{env.endpoint} sent no size or blob id for {name} "
                                                        "(is HF_ENDPOINT a Hugging Face hub?)")
        url = hf_hub_url(source.repo, name, revision=info.sha, endpoint=env.endpoint)
        files.append(HubFile(path=name, size=int(size), etag=etag, url=url))
    return HubPlan(source=source, commit=info.sha, files=tuple(files), storage=storage_dir(hub_cache, source.repo))


def _missing(source: HubSource):
    raise DownloadFailed(str(source), "not_found", f"{source.repo} has no file {source.path!r} at {source.ref}")


def link(plan: HubPlan, f: HubFile) -> None:
    """`snapshots/<commit>/<path>` -> the blob, relative (as huggingface_hub makes it)."""
    dst = plan.link(f)
    dst.parent.mkdir(parents=True, exist_ok=True)
    rel = os.path.relpath(plan.blob(f), dst.parent)
    if dst.is_symlink() or dst.exists():
        if dst.is_symlink() and os.readlink(dst) == rel:
            return
        dst.unlink()
    os.symlink(rel, dst)


def write_ref(plan: HubPlan) -> None:
    ref = plan.source.ref
    if ref == plan.commit:
        return
    p = plan.storage / "refs" / ref
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + f".{os.getpid()}.tmp")
    tmp.write_text(plan.commit)
    os.replace(tmp, p)


def hub_failure(source: HubSource, e: Exception, env: HubEnv) -> DownloadFailed:
    """huggingface_hub's exceptions as one reason each (401, 403, gated, 404 repo/revision/file, offline,
    connection)."""
    from huggingface_hub import errors as hf

    name, repo = str(source), source.repo
    status = getattr(getattr(e, "response", None), "status_code", None)
    if isinstance(e, DownloadFailed):
        return e
    if isinstance(e, hf.OfflineModeIsEnabled):
        return DownloadFailed(name, "offline", "HF_HUB_OFFLINE is set and the source is not in the node's cache")
    if isinstance(e, hf.GatedRepoError):
        return DownloadFailed(name, "auth", f"{repo} is gated: accept its terms on the hub with the account "
                                            "whose token is HF_TOKEN" + ("" if env.token else " (HF_TOKEN is not set)"))
    if isinstance(e, hf.RevisionNotFoundError):
        return DownloadFailed(name, "not_found", f"{repo} has no revision {source.ref!r}")
    if status == 401:
        if env.token:
            return DownloadFailed(name, "auth", f"the hub refused the token (HF_TOKEN) for {repo}: it is invalid "
                                                "or has no access (HTTP 401)")
        return DownloadFailed(name, "auth", f"the hub answered HTTP 401 for {repo}: it is private or gated, or "
                                            "does not exist; set HF_TOKEN in the node agent's environment")
    if status == 403:
        return DownloadFailed(name, "auth", f"the hub refused access to {repo} (HTTP 403): the token (HF_TOKEN) "
                                            "has no access")
    if isinstance(e, hf.RepositoryNotFoundError) or status == 404:
        return DownloadFailed(name, "not_found", f"the hub {env.endpoint} has no repository {repo} (HTTP 404)")
    if isinstance(e, hf.HfHubHTTPError) and status is not None:
        return DownloadFailed(name, "server", f"the hub answered HTTP {status} for {repo}",
                              retryable=status in (408, 429) or status >= 500)
    if type(e).__module__.startswith(("httpx", "httpcore")) or isinstance(e, (ConnectionError, TimeoutError)):
        return DownloadFailed(name, "connection", f"cannot reach the hub at {env.endpoint}: {e}", retryable=True)
    raise e
