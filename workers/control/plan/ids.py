"""Replica ids: deterministic within a pass (same inputs, same ids), never colliding with existing ones."""

from __future__ import annotations

import hashlib
import re
from typing import Callable


def slug(text: str) -> str:
    """`text` as a piece of an id: letters, digits, `_`, `.`, `-`, at most 40."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-")[:40] or "x"


def default_id_factory(now: float, taken: set[str]) -> Callable[[str, str], str]:
    """Deterministic ids (same inputs, same ids) that never collide with `taken`."""
    counter = [0]
    prefixes: dict[tuple[str, str], str] = {}
    stem = hashlib.sha1(repr(now).encode()).hexdigest()[:6]  # differs from pass to pass

    def new_id(model: str, profile: str) -> str:
        prefix = prefixes.get((model, profile))
        if prefix is None:
            prefix = prefixes[(model, profile)] = f"{slug(model)}-{slug(profile)}-{stem}"
        while True:
            counter[0] += 1
            rid = f"{prefix}{counter[0]:02x}"
            if rid not in taken:
                taken.add(rid)
                return rid

    return new_id
