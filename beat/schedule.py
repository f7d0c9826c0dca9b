"""The periodic control tasks. Each entry expires before its next run, so a backlog built up while
the control worker was down is dropped instead of replayed."""

from __future__ import annotations

from llmgw.config import Settings


def beat_schedule(settings: Settings) -> dict:
    def entry(task: str, every: float) -> dict:
        return {"task": task, "schedule": every, "options": {"queue": "control", "expires": every * 0.9}}

    return {
        "reconcile": entry("llmgw.reconcile", settings.reconcile_interval),
        "publish": entry("llmgw.publish", settings.publish_interval),
        "housekeeping": entry("llmgw.housekeeping", 30.0),
    }
