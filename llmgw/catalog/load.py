"""Reading a catalog from YAML text or a file: problems point at their line, duplicate keys are errors."""

from __future__ import annotations

from pathlib import Path

import yaml

from llmgw.catalog.types import Catalog
from llmgw.catalog.validate import join_path, parse_catalog
from llmgw.errors import CatalogInvalid, Problem

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


def parse_catalog_text(text: str, source: str = "<catalog>") -> Catalog:
    """Parse YAML text; problems carry the line they point at, and duplicate keys are errors."""
    try:
        loader = _LineLoader(text)
        try:
            node = loader.get_single_node()
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


def load_catalog_file(path: str | Path) -> Catalog:
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        reason = getattr(e, "strerror", None) or str(e)
        raise CatalogInvalid(str(path), [Problem("", f"cannot read: {reason}")]) from e
    return parse_catalog_text(text, str(path))
