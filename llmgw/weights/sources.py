"""A profile's `source:` parsed: a Hugging Face repository, a URL, a local path or a packaged file.

    hf://ORG/REPO[@REVISION][/FILE-OR-PATTERN]   hf://bartowski/Qwen2.5-7B-Instruct-GGUF/*Q4_K_M.gguf
    https://host/path/file.gguf[#sha256=HEX]     (http:// too: a mirror on the LAN, the tests' loopback)
    pkg:PACKAGE/FILE                             a GGUF shipped in an installed wheel
    anything else                                a path on the node (vLLM also resolves `org/name` itself)

Parsing is pure and says precisely what is wrong. `engine_refusal` states which engine takes which:
vLLM a whole repository or a directory; llama.cpp exactly one GGUF file, so a pattern must match one
file once the repository is listed (`select_gguf`; a split GGUF `-00001-of-00003.gguf` is one file).
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Iterable, Union
from urllib.parse import unquote, urlsplit

from llmgw.weights.errors import DownloadFailed, SourceInvalid

HF_FORM = "expected hf://ORG/REPO[@REVISION][/FILE-OR-PATTERN]"
# Hub names: letters, digits, '.', '_', '-'; at most 96 characters; no '--' or '..' (the hub's rule).
_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?$")
_REVISION = re.compile(r"^(?:refs/pr/\d+|[A-Za-z0-9][A-Za-z0-9._-]{0,254})$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_PKG = re.compile(r"^pkg:([A-Za-z0-9][A-Za-z0-9._-]*)/(.+)$")
_GLOB = re.compile(r"[*?\[]")
# A split GGUF: llama.cpp loads the first part and finds the others beside it by name.
SPLIT_GGUF = re.compile(r"^(?P<stem>.+)-(?P<part>\d{5})-of-(?P<total>\d{5})\.gguf$", re.IGNORECASE)


@dataclass(frozen=True)
class HubSource:
    repo: str  # ORG/REPO
    revision: str | None = None  # None: the default branch (main)
    path: str | None = None  # a file or a glob inside the repository

    @property
    def ref(self) -> str:
        return self.revision or "main"

    @property
    def is_pattern(self) -> bool:
        return bool(self.path and _GLOB.search(self.path))

    def __str__(self) -> str:
        rev = f"@{self.revision}" if self.revision else ""
        return f"hf://{self.repo}{rev}" + (f"/{self.path}" if self.path else "")


@dataclass(frozen=True)
class UrlSource:
    url: str  # without the fragment
    sha256: str | None = None

    @property
    def filename(self) -> str:
        return unquote(PurePosixPath(urlsplit(self.url).path).name)

    def __str__(self) -> str:
        return self.url + (f"#sha256={self.sha256}" if self.sha256 else "")


@dataclass(frozen=True)
class LocalPath:
    path: str

    @property
    def may_be_hub_id(self) -> bool:
        """`org/name` that is not an absolute path: vLLM resolves it itself (a directory if one exists
        there, else a Hugging Face id it downloads on its own)."""
        return not self.path.startswith(("/", "~", ".")) and bool(re.match(r"^[\w.-]+/[\w.-]+$", self.path))

    def __str__(self) -> str:
        return self.path


@dataclass(frozen=True)
class PackageFile:
    package: str
    file: str

    def __str__(self) -> str:
        return f"pkg:{self.package}/{self.file}"


Source = Union[HubSource, UrlSource, LocalPath, PackageFile]
REMOTE = (HubSource, UrlSource)


def parse_source(text: str) -> Source | None:
    """The source `text` names, or None when it is empty (the engine's default: vLLM loads the model's
    name). Raises SourceInvalid with what is wrong and what the form is."""
    text = text.strip()
    if not text:
        return None
    if text.startswith("hf://"):
        return _parse_hub(text)
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", text):
        return _parse_url(text)
    if text.startswith("pkg:"):
        m = _PKG.match(text)
        if not m:
            raise SourceInvalid(text, "expected pkg:<package>/<file>")
        return PackageFile(m.group(1), m.group(2))
    if "\x00" in text:
        raise SourceInvalid(text, "a path cannot contain a NUL character")
    return LocalPath(text)


def _parse_hub(text: str) -> HubSource:
    rest = text[len("hf://"):]
    parts = rest.split("/")
    if len(parts) < 2 or not parts[0] or not parts[1]:
        raise SourceInvalid(text, HF_FORM)
    org, name = parts[0], parts[1]
    tail = parts[2:]
    revision = None
    if "@" in name:
        name, revision = name.split("@", 1)
        if revision == "refs" and tail[:1] == ["pr"] and len(tail) >= 2:  # @refs/pr/N
            revision, tail = "/".join(["refs", *tail[:2]]), tail[2:]
        if not revision:
            raise SourceInvalid(text, f"empty revision after '@': {HF_FORM}")
        if not _REVISION.match(revision):
            raise SourceInvalid(text, f"revision {revision!r} must be a branch, a tag, a commit or refs/pr/N")
    for what, value in (("organisation", org), ("repository", name)):
        if "@" in value or not _NAME.match(value) or "--" in value or ".." in value:
            raise SourceInvalid(text, f"{what} {value!r} must be 1-96 letters, digits, '.', '_' or '-' "
                                      f"(no '--' or '..'): {HF_FORM}")
    path = "/".join(tail) if tail else None
    if path is not None:
        bad = [s for s in tail if s in ("", ".", "..")]
        if bad or "\\" in path:
            raise SourceInvalid(text, "the file part must be a relative path inside the repository "
                                      "(no empty, '.' or '..' parts, no backslashes)")
    return HubSource(repo=f"{org}/{name}", revision=revision, path=path)


def _parse_url(text: str) -> UrlSource:
    try:
        parts = urlsplit(text)
        port = parts.port  # raises ValueError for a port that is not a number
    except ValueError as e:
        raise SourceInvalid(text, f"not a URL: {e}") from None
    if parts.scheme not in ("https", "http"):
        raise SourceInvalid(text, f"unknown scheme {parts.scheme}://: a source is hf://..., https://..., "
                                  "a path on the node or pkg:<package>/<file>")
    if not parts.hostname:
        raise SourceInvalid(text, "the URL has no host")
    if parts.username or parts.password:
        raise SourceInvalid(text, "credentials in a URL would be stored with the catalog: serve the file "
                                  "without them, or from a hub with HF_TOKEN in the node's environment")
    if not parts.path or parts.path.endswith("/"):
        raise SourceInvalid(text, "the URL must name a file (its path ends in a file name)")
    sha = None
    if parts.fragment:
        key, _, value = parts.fragment.partition("=")
        if key != "sha256" or not _SHA256.match(value.lower()):
            raise SourceInvalid(text, "the only fragment a URL source takes is #sha256=<64 hex digits>")
        sha = value.lower()
    netloc = parts.hostname + (f":{port}" if port else "")
    if ":" in parts.hostname:
        netloc = f"[{parts.hostname}]" + (f":{port}" if port else "")
    url = f"{parts.scheme}://{netloc}{parts.path}" + (f"?{parts.query}" if parts.query else "")
    return UrlSource(url=url, sha256=sha)


def _names_gguf(path: str | None) -> bool:
    return bool(path) and path.lower().endswith(".gguf")


def engine_refusal(source: Source | None, engine: str, who: str | None = None) -> str | None:
    """Why `engine` cannot load `source` (None: it can). `who` names the engine (and profile) in the
    reason, as the engine drivers' own messages do."""
    who = who or engine
    if engine == "vllm":
        if isinstance(source, HubSource) and source.path:
            return (f"{who} loads a whole repository: write hf://{source.repo}"
                    f"{'@' + source.revision if source.revision else ''} without a file or pattern")
        if isinstance(source, UrlSource):
            return f"{who} loads a Hugging Face repository or a directory, not a single file from a URL"
        if isinstance(source, PackageFile):
            return f"{who} loads a Hugging Face id or a directory, not pkg:<package>/<file>"
        return None
    if engine == "llamacpp":
        if source is None:
            return f"{who} needs a source: a .gguf file path, hf://ORG/REPO/FILE.gguf or pkg:<package>/<file>"
        if isinstance(source, HubSource):
            if not source.path:
                return (f"{who} loads one GGUF file: name it or a pattern, e.g. "
                        f"hf://{source.repo}/*Q4_K_M.gguf")
            if not _names_gguf(source.path):
                return f"{who} loads a GGUF file: {source.path!r} must end in .gguf"
            return None
        name = source.filename if isinstance(source, UrlSource) else str(source)
        if not _names_gguf(name):
            return f"{who} loads a GGUF file: {str(source)!r} must end in .gguf (a profile may set its own `source`)"
    return None


def select_gguf(source: HubSource, files: Iterable[str]) -> tuple[str, ...]:
    """The repository files a llama.cpp source names: one GGUF, or every part of one split GGUF (the
    first part first). Raises DownloadFailed (not_found / ambiguous) naming what the repo has.

    `*` matches across folders (`*Q4_K_M*.gguf` finds `Q4_K_M/model-Q4_K_M-00001-of-00002.gguf`)."""
    names = sorted(set(files))
    ggufs = [f for f in names if f.lower().endswith(".gguf")]
    pattern = source.path or "*.gguf"
    hits = [f for f in ggufs if fnmatch.fnmatchcase(f, pattern)] if _GLOB.search(pattern) else \
        [f for f in ggufs if f == pattern]
    sets = _split_sets(hits, ggufs)
    if not sets:
        listed = ", ".join(ggufs[:8]) + (f" and {len(ggufs) - 8} more" if len(ggufs) > 8 else "")
        have = f"its GGUF files: {listed}" if ggufs else "it has no .gguf file"
        raise DownloadFailed(str(source), "not_found", f"{pattern!r} matches no file in {source.repo} "
                                                       f"at {source.ref} ({have})")
    if len(sets) > 1:
        firsts = ", ".join(s[0] for s in sets[:6]) + (" ..." if len(sets) > 6 else "")
        raise DownloadFailed(str(source), "ambiguous", f"{pattern!r} matches {len(sets)} models in "
                                                       f"{source.repo}: {firsts}; name one")
    return sets[0]


def _split_sets(hits: list[str], ggufs: list[str]) -> list[tuple[str, ...]]:
    """Group matched files into models: a split GGUF's parts (all of them, found among `ggufs` even
    when the pattern matched only some) count as one."""
    out: dict[str, tuple[str, ...]] = {}
    for f in hits:
        m = SPLIT_GGUF.match(f)
        if not m:
            out[f] = (f,)
            continue
        key = f"{m.group('stem')}-of-{m.group('total')}"
        if key in out:
            continue
        parts = sorted(g for g in ggufs if (n := SPLIT_GGUF.match(g)) and n.group("stem") == m.group("stem")
                       and n.group("total") == m.group("total"))
        out[key] = tuple(parts)
    return list(out.values())


# Weight formats vLLM would not read when the repository has safetensors (what `vllm serve` itself
# skips), and the checkpoints some repositories carry twice.
_OTHER_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.h5", "*.msgpack", "*.ckpt", "*.onnx", "*.ot", "*.gguf",
                  "*.tflite", "*.mlmodel", "original/*", "*/original/*")


def select_repo_files(files: Iterable[str]) -> tuple[str, ...]:
    """What a vLLM replica needs of a repository: the configs, tokenizer and one weight format
    (safetensors when present, else the .bin files), without duplicate checkpoints."""
    names = sorted(set(files))
    has_st = any(f.endswith(".safetensors") for f in names)
    keep = []
    for f in names:
        if f == ".gitattributes":
            continue
        if has_st and any(fnmatch.fnmatchcase(f, p) for p in _OTHER_WEIGHTS):
            continue
        if not has_st and fnmatch.fnmatchcase(f, "*.gguf"):
            continue
        keep.append(f)
    if "model.safetensors.index.json" in keep:  # Mistral-style repos ship consolidated.safetensors too
        keep = [f for f in keep if not fnmatch.fnmatchcase(f, "consolidated*.safetensors")]
    return tuple(keep)
