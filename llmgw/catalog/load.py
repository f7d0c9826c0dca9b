"""Reading a catalog from YAML text or a file: problems point at their line, duplicate keys are errors.

Hostile input is refused before it costs much: a file over MAX_CATALOG_BYTES is not read, bytes that
are not UTF-8 are named by offset and line, and YAML whose aliases expand to more than
MAX_CATALOG_NODES nodes (a "billion laughs" bomb) is refused before anything walks the expansion."""

from __future__ import annotations

from pathlib import Path

import yaml

from llmgw.catalog.types import Catalog
from llmgw.catalog.problems import join_path
from llmgw.catalog.validate import parse_catalog
from llmgw.errors import CatalogInvalid, Problem

# Far above any fleet's catalog (a model with a few profiles is about a hundred nodes and a few KB).
MAX_CATALOG_BYTES = 8 * 1024 * 1024
MAX_CATALOG_NODES = 200_000

# libyaml's parser when PyYAML was built with it (about 10x faster), the pure-Python one otherwise;
# both keep node marks, which give each problem its line. Duplicate keys are found on the node tree.
_LineLoader = getattr(yaml, "CSafeLoader", None) or yaml.SafeLoader


def _line_map(node: yaml.Node, problems: list[Problem]) -> dict[str, int]:
    """Field path -> 1-based line, for pointing at the spot in the file; also finds duplicate keys."""
    lines: dict[str, int] = {}

    def walk(n: yaml.Node, path: str) -> None:
        lines.setdefault(path, n.start_mark.line + 1)
        if isinstance(n, yaml.MappingNode):
            seen: set[str] = set()
            for k, v in n.value:
                key = str(k.value) if isinstance(k, yaml.ScalarNode) else "?"
                child = join_path(path, key)
                if key in seen:
                    problems.append(Problem(child, f"duplicate key '{key}' (line {k.start_mark.line + 1})"))
                seen.add(key)
                lines.setdefault(child, k.start_mark.line + 1)
                walk(v, child)
        elif isinstance(n, yaml.SequenceNode):
            for i, v in enumerate(n.value):
                walk(v, f"{path}[{i}]")

    walk(node, "")
    return lines


def _line_of(path: str, lines: dict[str, int]) -> int | None:
    """The line of `path`, or of its nearest ancestor present in the file (a missing field)."""
    while path:
        if path in lines:
            return lines[path]
        cut = max(path.rfind("."), path.rfind("["))
        path = path[:cut] if cut > 0 else ""
    return None


def _too_big(size: int, source: str) -> CatalogInvalid:
    return CatalogInvalid(source, [Problem("", f"is {size:,} bytes; a catalog may be at most "
                                               f"{MAX_CATALOG_BYTES:,} bytes ({MAX_CATALOG_BYTES // 2**20} MiB)")])


def _expanded_size(node: yaml.Node, limit: int) -> int:
    """How many nodes the document has once its aliases are expanded, counting each distinct node's
    expansion once (linear in the text); stops counting past `limit`."""
    sizes: dict[int, int] = {}

    def size(n: yaml.Node) -> int:
        known = sizes.get(id(n))
        if known is not None:
            return known
        sizes[id(n)] = 1  # an alias back into itself counts once
        total = 1
        if isinstance(n, yaml.MappingNode):
            for k, v in n.value:
                total += size(k) + size(v)
                if total > limit:
                    break
        elif isinstance(n, yaml.SequenceNode):
            for v in n.value:
                total += size(v)
                if total > limit:
                    break
        sizes[id(n)] = total
        return total

    return size(node)


def parse_catalog_text(text: str, source: str = "<catalog>") -> Catalog:
    """Parse YAML text; problems carry the line they point at, and duplicate keys are errors."""
    if len(text) > MAX_CATALOG_BYTES:
        raise _too_big(len(text.encode("utf-8", errors="replace")), source)
    try:
        loader = _LineLoader(text)
        try:
            node = loader.get_single_node()
            if node is not None and _expanded_size(node, MAX_CATALOG_NODES) > MAX_CATALOG_NODES:
                raise CatalogInvalid(source, [Problem("", (
                    f"expands to more than {MAX_CATALOG_NODES:,} YAML nodes through its aliases (*name): a YAML "
                    "bomb, or far more than any catalog needs; write repeated parts out or use fewer aliases"))])
            data = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise CatalogInvalid(source, [Problem("", f"not valid YAML: {where}{what}")]) from e
    duplicates: list[Problem] = []  # these carry their own line already
    lines = _line_map(node, duplicates) if node is not None else {}
    try:
        catalog = parse_catalog(data, source)
    except CatalogInvalid as e:
        located = [(_line_of(p.path, lines), p) for p in e.problems]
        located = [(n, Problem(p.path, f"{p.reason} (line {n})") if n else p) for n, p in located]
        located += [(_line_of(p.path, lines), p) for p in duplicates]
        # In file order, so the list reads top to bottom like the file; problems without a line last.
        ordered = [p for _, p in sorted(located, key=lambda item: item[0] or 10**9)]
        raise CatalogInvalid(source, ordered) from None
    if duplicates:
        raise CatalogInvalid(source, duplicates)
    return catalog


def parse_catalog_bytes(data: bytes, source: str = "<catalog>") -> Catalog:
    """`parse_catalog_text` of a file's bytes, which must be UTF-8 (a bad byte is named, never replaced)."""
    if len(data) > MAX_CATALOG_BYTES:
        raise _too_big(len(data), source)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise CatalogInvalid(source, [Problem("", f"is not UTF-8 text: byte 0x{data[e.start]:02x} at offset "
                                                  f"{e.start} (line {line})")]) from None
    return parse_catalog_text(text, source)


def check_catalog_size(path: Path) -> None:
    """Refuse a file too big to be a catalog before reading it (CatalogInvalid; OSError if missing)."""
    size = path.stat().st_size
    if size > MAX_CATALOG_BYTES:
        raise _too_big(size, str(path))


def load_catalog_file(path: str | Path) -> Catalog:
    path = Path(path)
    try:
        check_catalog_size(path)
        data = path.read_bytes()
    except OSError as e:
        raise CatalogInvalid(str(path), [Problem("", f"cannot read: {e.strerror or e}")]) from e
    return parse_catalog_bytes(data, str(path))
