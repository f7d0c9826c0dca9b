"""What applying a catalog would change: a pure function of (applied, new) returning data.

`diff_catalogs(old, new)` lists models and profiles added, removed and changed, with replica counts
and whether a change restarts replicas (the profile's spec hash changed) or is taken live (everything
outside LAUNCH_FIELDS). `format_diff` renders it for `llmgw catalog apply`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal

from llmgw.catalog import Catalog, Model, Profile, profile_spec_hash

Kind = Literal["added", "removed", "changed"]


@dataclass(frozen=True)
class FieldChange:
    field: str
    before: object
    after: object


@dataclass(frozen=True)
class ProfileDiff:
    model: str
    profile: str
    kind: Kind
    replicas_before: int
    replicas_after: int
    changes: tuple[FieldChange, ...] = ()
    restart: bool = False  # running replicas are replaced (their process spec changed)


@dataclass(frozen=True)
class ModelDiff:
    model: str
    kind: Kind
    changes: tuple[FieldChange, ...] = ()  # aliases, source
    profiles: tuple[ProfileDiff, ...] = ()


@dataclass(frozen=True)
class CatalogDiff:
    models: tuple[ModelDiff, ...] = field(default_factory=tuple)
    replicas_before: int = 0
    replicas_after: int = 0

    @property
    def empty(self) -> bool:
        return not self.models

    def count(self, kind: Kind) -> int:
        return sum(1 for m in self.models if m.kind == kind)


def _profile_fields(p: Profile) -> dict:
    return p.model_dump(mode="json", by_alias=True)


def _field_changes(before: dict, after: dict, skip: tuple[str, ...] = ()) -> tuple[FieldChange, ...]:
    names = [k for k in after if k not in skip] + [k for k in before if k not in after and k not in skip]
    return tuple(FieldChange(k, before.get(k), after.get(k)) for k in names if before.get(k) != after.get(k))


def _diff_profiles(old: Model | None, new: Model | None) -> tuple[ProfileDiff, ...]:
    name = (new or old).name  # type: ignore[union-attr]
    before = {p.name: p for p in old.profiles} if old else {}
    after = {p.name: p for p in new.profiles} if new else {}
    out: list[ProfileDiff] = []
    for pname, p in after.items():
        q = before.get(pname)
        if q is None:
            out.append(ProfileDiff(name, pname, "added", 0, p.replicas))
            continue
        changes = _field_changes(_profile_fields(q), _profile_fields(p), skip=("name",))
        restart = profile_spec_hash(old, q) != profile_spec_hash(new, p)  # type: ignore[arg-type]
        if changes or restart:
            out.append(ProfileDiff(name, pname, "changed", q.replicas, p.replicas, changes, restart))
    for pname, q in before.items():
        if pname not in after:
            out.append(ProfileDiff(name, pname, "removed", q.replicas, 0))
    return tuple(out)


def diff_catalogs(old: Catalog | None, new: Catalog) -> CatalogDiff:
    """The changes from `old` (None: nothing applied yet) to `new`, in `new`'s order then removals."""
    old = old or Catalog()
    before = {m.name: m for m in old.models}
    models: list[ModelDiff] = []
    for m in new.models:
        o = before.get(m.name)
        if o is None:
            models.append(ModelDiff(m.name, "added", profiles=_diff_profiles(None, m)))
            continue
        changes = _field_changes(
            {"aliases": o.aliases, "source": o.source}, {"aliases": m.aliases, "source": m.source}
        )
        profiles = _diff_profiles(o, m)
        if changes or profiles:
            models.append(ModelDiff(m.name, "changed", changes, profiles))
    names = {m.name for m in new.models}
    for o in old.models:
        if o.name not in names:
            models.append(ModelDiff(o.name, "removed", profiles=_diff_profiles(o, None)))
    return CatalogDiff(tuple(models), old.total_replicas(), new.total_replicas())


# --- rendering -----------------------------------------------------------------------------------

_MARK = {"added": "+", "removed": "-", "changed": "~"}


def _show(value: object) -> str:
    if value is None:
        return "none"
    if isinstance(value, str):
        return value or '""'
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _replicas(n: int) -> str:
    return f"{n} replica" + ("" if n == 1 else "s")


def _hardware(p: Profile) -> str:
    if p.gpu is None:
        return "cpu"
    hw = f"{p.gpu.count}x{p.gpu.gpu_class}"
    return hw + (f" on {p.nodes} nodes" if p.nodes > 1 else "")


def format_diff(diff: CatalogDiff, new: Catalog | None = None) -> list[str]:
    """Lines for a person: one per model and profile change, then a summary line."""
    if diff.empty:
        return ["no changes"]
    lines: list[str] = []
    for m in diff.models:
        head = f"{_MARK[m.kind]} model {m.model}"
        if m.kind == "changed" and m.changes:
            head += ": " + ", ".join(f"{c.field} {_show(c.before)} -> {_show(c.after)}" for c in m.changes)
        lines.append(head)
        for p in m.profiles:
            mark = _MARK[p.kind]
            label = f"  {mark} profile {p.model}/{p.profile}"
            if p.kind == "added":
                prof = new.model(p.model).profile(p.profile) if new and new.model(p.model) else None
                extra = f" ({prof.engine}, {_hardware(prof)}, priority {prof.priority})" if prof else ""
                lines.append(f"{label}: {_replicas(p.replicas_after)}{extra}")
            elif p.kind == "removed":
                lines.append(f"{label}: {_replicas(p.replicas_before)} stop")
            else:
                parts = []
                if p.replicas_before != p.replicas_after:
                    parts.append(f"replicas {p.replicas_before} -> {p.replicas_after}")
                for c in p.changes:
                    if c.field != "replicas":
                        parts.append(f"{c.field} {_show(c.before)} -> {_show(c.after)}")
                if not parts:
                    parts.append("model source or names changed")
                # The spec hash decides: what does not change the launched process applies live.
                suffix = " [replicas restart]" if p.restart else " [live]"
                lines.append(f"{label}: " + "; ".join(parts) + suffix)
    lines.append(
        f"{diff.count('added')} added, {diff.count('changed')} changed, {diff.count('removed')} removed; "
        f"replicas {diff.replicas_before} -> {diff.replicas_after}"
    )
    return lines
