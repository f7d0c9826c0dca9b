"""What a model is made of, read from the weights' own headers without reading the weights.

GGUF: the header (magic, version, key/values, tensor infos) sits at the start of the file, before the
tensor data; `read_gguf` walks it through a `fetch(offset, length)` callable, so the same code reads a
local file or the first megabytes of a remote one (ranged GETs). It skips the tokenizer's arrays
instead of decoding them (`gguf.GGUFReader` builds numpy views of every field and needs the whole file
on disk: 16 s for SmolLM2-135M's header here). Tensor bytes use the `gguf` package's block sizes.
safetensors: 8 bytes of little-endian header length, then JSON with each tensor's dtype, shape and
byte range. `config.json` gives layers, KV heads, head size, vocabulary and context length.
"""

from __future__ import annotations

import glob
import json
import math
import re
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping

Fetch = Callable[[int, int], bytes]  # (offset, length) -> bytes (shorter only at the end of the file)

MAX_GGUF_HEADER = 256 * 1024 * 1024
MAX_ST_HEADER = 100 * 1024 * 1024  # huggingface_hub's own limit is 25 MB
ST_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
                  "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
                  "F6_E2M3": 0.75, "F6_E3M2": 0.75, "F4": 0.5}
TORCH_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "float64": 8}


class MetaError(ValueError):
    """The header is not what its format says (truncated, wrong magic, too large)."""


@dataclass(frozen=True)
class Shape:
    """The numbers a memory estimate needs. `kv_elems_per_token`: K and V elements one token adds to
    the cache over all layers (per-layer KV head counts summed)."""

    weights_bytes: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    kv_elems_per_token: int
    hidden: int = 0
    ff: int = 0
    vocab: int = 0
    context_length: int = 0
    dtype_bytes: float = 2.0  # of the weights (safetensors/config); the KV cache defaults to it in vLLM
    architecture: str = ""
    by_dtype: tuple[tuple[str, int], ...] = ()  # (dtype, bytes)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Shape":
        """A shape as stored (JSON): unknown keys are ignored, the dtype pairs become tuples again."""
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        known["by_dtype"] = tuple((str(k), int(n)) for k, n in known.get("by_dtype") or ())
        return cls(**known)


# --- GGUF -----------------------------------------------------------------------------------------
class _Cursor:
    def __init__(self, fetch: Fetch, chunk: int = 1 << 20):
        self.fetch, self.chunk = fetch, chunk
        self.buf, self.base, self.pos = b"", 0, 0

    def take(self, n: int) -> bytes:
        end = self.pos + n
        self.ensure(end)
        out = self.buf[self.pos - self.base:end - self.base]
        self.pos = end
        return out

    def ensure(self, end: int) -> None:
        if end > MAX_GGUF_HEADER:
            raise MetaError(f"GGUF header larger than {MAX_GGUF_HEADER} bytes")
        while end > self.base + len(self.buf):
            want = max(self.chunk, end - self.base - len(self.buf))
            more = self.fetch(self.base + len(self.buf), want)
            if not more:
                raise MetaError("the GGUF header is truncated")
            self.buf += more
            self.chunk = min(self.chunk * 2, 64 << 20)

    def skip_strings(self, n: int) -> None:
        """Step over `n` length-prefixed strings (a tokenizer's vocabulary) without decoding them."""
        unpack, pos = struct.unpack_from, self.pos
        for _ in range(n):
            self.ensure(pos + 8)
            (ln,) = unpack("<Q", self.buf, pos - self.base)
            pos += 8 + ln
        self.ensure(pos)
        self.pos = pos

    def u32(self) -> int:
        return struct.unpack("<I", self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.take(8))[0]

    def string(self) -> str:
        return self.take(self.u64()).decode("utf-8", "replace")


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# Arrays longer than this are counted, not kept (the tokenizer's vocabulary and merges).
_KEEP_ARRAY = 4096


def _value(c: _Cursor, vtype: int) -> Any:
    if vtype in _SCALARS:
        fmt = _SCALARS[vtype]
        return struct.unpack(fmt, c.take(struct.calcsize(fmt)))[0]
    if vtype == _STRING:
        return c.string()
    if vtype == _ARRAY:
        etype, n = c.u32(), c.u64()
        if etype in _SCALARS and n > _KEEP_ARRAY:
            c.take(struct.calcsize(_SCALARS[etype]) * n)
            return _Count(n)
        if n > _KEEP_ARRAY and etype == _STRING:
            c.skip_strings(n)
            return _Count(n)
        if n > _KEEP_ARRAY:
            for _ in range(n):
                _value(c, etype)
            return _Count(n)
        return [_value(c, etype) for _ in range(n)]
    raise MetaError(f"unknown GGUF value type {vtype}")


class _Count(int):
    """A long array's length (its contents were skipped)."""


@dataclass(frozen=True)
class GgufHeader:
    version: int
    fields: dict[str, Any]
    tensors: tuple[tuple[str, tuple[int, ...], int], ...]  # (name, shape, ggml type)
    header_bytes: int

    def tensor_bytes(self) -> int:
        return sum(tensor_nbytes(shape, t) for _, shape, t in self.tensors)


def tensor_nbytes(shape: tuple[int, ...], ggml_type: int) -> int:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise MetaError(f"unknown GGML tensor type {ggml_type}") from None
    return math.prod(shape) // block * size


def read_gguf(fetch: Fetch) -> GgufHeader:
    c = _Cursor(fetch)
    if c.take(4) != b"GGUF":
        raise MetaError("not a GGUF file (no GGUF magic)")
    version = c.u32()
    if version not in (2, 3):
        raise MetaError(f"GGUF version {version} is not supported (2 and 3 are)")
    n_tensors, n_kv = c.u64(), c.u64()
    fields = {}
    for _ in range(n_kv):
        key = c.string()
        fields[key] = _value(c, c.u32())
    tensors = []
    for _ in range(n_tensors):
        name = c.string()
        dims = tuple(c.u64() for _ in range(c.u32()))
        ttype = c.u32()
        c.u64()  # offset into the data section
        tensors.append((name, dims, ttype))
    return GgufHeader(version, fields, tuple(tensors), c.pos)


def gguf_shape(h: GgufHeader) -> Shape:
    f = h.fields
    arch = str(f.get("general.architecture", ""))
    a = lambda k, d=0: f.get(f"{arch}.{k}", d)  # noqa: E731
    layers = int(a("block_count"))
    heads = _per_layer(a("attention.head_count"), layers)
    kv = _per_layer(a("attention.head_count_kv", 0), layers) or heads
    kv = [k or h_ for k, h_ in zip(kv, heads)] if len(kv) == len(heads) else kv
    hidden = int(a("embedding_length"))
    head_dim = int(a("attention.key_length", 0)) or (hidden // max(heads[0], 1) if heads else 0)
    v_dim = int(a("attention.value_length", 0)) or head_dim
    ff = _per_layer(a("feed_forward_length", 0), layers)
    vocab = int(a("vocab_size", 0)) or int(f.get("tokenizer.ggml.tokens", 0) if isinstance(
        f.get("tokenizer.ggml.tokens"), int) else len(f.get("tokenizer.ggml.tokens") or ()))
    return Shape(weights_bytes=h.tensor_bytes(), layers=layers, heads=max(heads, default=0),
                 kv_heads=max(kv, default=0), head_dim=head_dim,
                 kv_elems_per_token=sum(k * (head_dim + v_dim) for k in kv), hidden=hidden,
                 ff=max(ff, default=0), vocab=vocab, context_length=int(a("context_length", 0)),
                 architecture=arch)


def _per_layer(v: Any, layers: int) -> list[int]:
    if isinstance(v, list):
        return [int(x) for x in v][:layers] if v else []
    return [int(v)] * layers if v else []


# --- safetensors and config.json ------------------------------------------------------------------
def read_safetensors_header(fetch: Fetch) -> dict[str, Any]:
    head = fetch(0, 8)
    if len(head) < 8:
        raise MetaError("the safetensors file is shorter than its 8-byte header length")
    (n,) = struct.unpack("<Q", head)
    if n > MAX_ST_HEADER:
        raise MetaError(f"safetensors header of {n} bytes is larger than {MAX_ST_HEADER}")
    raw = fetch(8, n)
    if len(raw) < n:
        raise MetaError("the safetensors header is truncated")
    try:
        return json.loads(raw)
    except ValueError as e:
        raise MetaError(f"the safetensors header is not JSON: {e}") from None


def safetensors_bytes(header: Mapping[str, Any]) -> dict[str, int]:
    """Bytes by dtype of one file's tensors (from their byte ranges)."""
    out: dict[str, int] = {}
    for name, t in header.items():
        if name == "__metadata__" or not isinstance(t, dict):
            continue
        lo, hi = t.get("data_offsets", (0, 0))
        out[t.get("dtype", "?")] = out.get(t.get("dtype", "?"), 0) + int(hi) - int(lo)
    return out


def config_shape(config: Mapping[str, Any], by_dtype: Mapping[str, int]) -> Shape:
    """The shape from a Hugging Face `config.json` (its `text_config` for a multimodal model) and the
    safetensors' bytes by dtype."""
    c = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    g = lambda *keys, d=0: next((c[k] for k in keys if c.get(k) is not None), d)  # noqa: E731
    layers = int(g("num_hidden_layers", "n_layer", "num_layers"))
    heads = int(g("num_attention_heads", "n_head"))
    kv = int(g("num_key_value_heads", "n_head_kv", d=heads))
    hidden = int(g("hidden_size", "n_embd", "d_model"))
    head_dim = int(g("head_dim", d=hidden // max(heads, 1)))
    dtype = str(g("torch_dtype", "dtype", d="bfloat16")).replace("torch.", "")
    ctx = [int(c[k]) for k in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                                "max_sequence_length") if isinstance(c.get(k), int)]
    return Shape(weights_bytes=sum(by_dtype.values()), layers=layers, heads=heads, kv_heads=kv, head_dim=head_dim,
                 kv_elems_per_token=layers * kv * 2 * head_dim, hidden=hidden,
                 ff=int(g("intermediate_size", "n_inner", d=4 * hidden)), vocab=int(g("vocab_size", d=0)),
                 context_length=min(ctx) if ctx else 0, dtype_bytes=TORCH_DTYPE_BYTES.get(dtype, 2),
                 architecture=str((config.get("architectures") or [""])[0]), by_dtype=tuple(sorted(by_dtype.items())))


# --- readers --------------------------------------------------------------------------------------
def file_fetch(path: Path) -> Fetch:
    def fetch(offset: int, length: int) -> bytes:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(length)
    return fetch


def http_fetch(session, url: str, headers: Mapping[str, str] | None = None, timeout: float = 30.0) -> Fetch:
    """Ranged GETs of `url` (`Range: bytes=a-b`): a remote header without the file."""
    def fetch(offset: int, length: int) -> bytes:
        r = session.get(url, headers={**(headers or {}), "Range": f"bytes={offset}-{offset + length - 1}",
                                      "Accept-Encoding": "identity"}, timeout=timeout, allow_redirects=True)
        if r.status_code == 416:
            return b""
        if r.status_code not in (200, 206):
            raise MetaError(f"HTTP {r.status_code} reading bytes {offset}-{offset + length - 1} of {url}")
        data = r.content
        return data[offset:offset + length] if r.status_code == 200 else data
    return fetch


def shape_of(files: Mapping[str, Fetch]) -> Shape:
    """The shape of a model from its files, each given as a fetch (local or ranged remote): the GGUF
    file(s) (every part of a split GGUF: the first holds the metadata, each its own tensors), else
    `config.json` and the `*.safetensors` headers."""
    ggufs = sorted(k for k in files if k.lower().endswith(".gguf"))
    if ggufs:
        headers = [read_gguf(files[k]) for k in ggufs]
        first = gguf_shape(headers[0])
        return replace(first, weights_bytes=sum(h.tensor_bytes() for h in headers))
    if "config.json" not in files:
        raise MetaError("no GGUF file and no config.json: nothing to estimate from")
    config = json.loads(files["config.json"](0, 16 << 20))
    by_dtype: dict[str, int] = {}
    for k in sorted(k for k in files if k.endswith(".safetensors")):
        for dt, n in safetensors_bytes(read_safetensors_header(files[k])).items():
            by_dtype[dt] = by_dtype.get(dt, 0) + n
    return config_shape(config, by_dtype)


def local_shape(path: Path) -> Shape:
    """The shape of a local GGUF file (with the other parts of a split one beside it), or of a model
    directory (config.json + *.safetensors)."""
    path = Path(path)
    if path.is_file():
        m = re.match(r"^(.+)-\d{5}-of-(\d{5})\.gguf$", path.name, re.IGNORECASE)
        parts = sorted(path.parent.glob(f"{glob.escape(m.group(1))}-*-of-{m.group(2)}.gguf")) if m else [path]
        return shape_of({p.name: file_fetch(p) for p in parts})
    return shape_of({p.name: file_fetch(p) for p in sorted(path.iterdir()) if p.is_file()})
