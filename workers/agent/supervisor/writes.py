"""One pass's writes: the facts of every action merged per replica, so the agent writes each record
once (one pipeline for all of them) instead of once per action."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from llmgw.state.records import ReplicaRecord
from workers.agent.supervisor.actions import Facts
from workers.agent.supervisor.policy import LOG_TAIL_BYTES

_RECORD_FIELDS = frozenset(f.name for f in dataclasses.fields(ReplicaRecord))


@dataclass(frozen=True)
class Writes:
    records: dict[str, dict[str, Any]] = field(default_factory=dict)  # replica id -> fields of its record
    members: dict[str, dict[str, Any]] = field(default_factory=dict)  # a member part's facts: the agent's memory


def merge(facts: Iterable[tuple[ReplicaRecord, Facts]], node: str, tails: Mapping[str, str] | None = None) -> Writes:
    """Each action's facts, in order (a later value of a field wins), sent where they belong: a part's
    facts to the record when this node heads it (or it has one node), else to this agent's memory of
    the member part; confirmations to the record either way. `tails`: the end of each engine log
    read for the facts that record one (`Facts.tail`)."""
    records: dict[str, dict[str, Any]] = {}
    members: dict[str, dict[str, Any]] = {}
    for rec, facts in facts:
        fields = dict(facts.fields)
        if facts.tail is not None:
            fields["log_tail"] = ((tails or {}).get(rec.id, "") + facts.tail)[-LOG_TAIL_BYTES:]
        (records if rec.node == node else members).setdefault(rec.id, {}).update(fields)
        if facts.confirm:
            records.setdefault(rec.id, {}).update(facts.confirm)
    return Writes(records, members)


def with_fields(rec: ReplicaRecord, fields: Mapping[str, Any]) -> ReplicaRecord:
    """`rec` as writing `fields` leaves it (a member's `joined_attempt`, no record field, is left out)."""
    return dataclasses.replace(rec, **{k: v for k, v in fields.items() if k in _RECORD_FIELDS})
