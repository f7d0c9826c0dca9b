"""LoRA adapters: how the last reconcile pass placed each one (one JSON value, `keys.ADAPTERS`). The
facts of each replica's adapters are fields of its replica record (`replicas.py`)."""

from __future__ import annotations

import json
from typing import Iterable, Iterator

from llmgw.state import keys
from llmgw.state.store.base import Aggregate, Pipeline, compact
from llmgw.state.views import AdapterRows


def queue_rows(pipe: Pipeline) -> None:
    pipe.get(keys.ADAPTERS)


def take_rows(replies: Iterator) -> AdapterRows:
    """(when, rows) of the last pass that placed adapters; (None, []) when none did or the value is
    unreadable (a newer or broken writer)."""
    raw = next(replies)
    try:
        doc = json.loads(raw) if raw else {}
        rows = [r for r in doc.get("rows") or [] if isinstance(r, dict) and "adapter" in r]
        return AdapterRows((float(doc["at"]) if doc.get("at") is not None else None), rows)
    except (ValueError, TypeError, AttributeError):
        return AdapterRows(None, [])


class Adapters(Aggregate):
    def write_adapter_rows(self, rows: Iterable[dict], at: float) -> None:
        """The pass's rows (`workers.control.adapterplan.AdapterRow.to_dict`); none: the key goes."""
        rows = list(rows)
        if rows:
            self.r.set(keys.ADAPTERS, compact({"at": at, "rows": rows}))
        else:
            self.r.delete(keys.ADAPTERS)

    def adapter_rows(self) -> AdapterRows:
        """`take_rows` of one read (status and the console read it; a reconcile pass reads it in its
        `fleet_view`)."""
        return take_rows(iter([self.r.get(keys.ADAPTERS)]))
