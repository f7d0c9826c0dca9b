"""`llmgw logs` (placeholder until its issue lands)."""

from __future__ import annotations


def register(sub) -> None:
    pass
