"""Celery beat's schedule for llmgw's control tasks (run exactly one `celery -A workers beat`).

Each entry expires before its next run, so a backlog built up while the control worker was down is
dropped instead of replayed; the tasks' Redis locks keep a slow pass from overlapping the next one.
"""

from __future__ import annotations

from llmgw.config import Settings

HOUSEKEEPING_INTERVAL = 30.0  # seconds; cheap tidying (docs/control-plane.md)


def beat_schedule(settings: Settings) -> dict:
    def entry(task: str, every: float) -> dict:
        return {"task": task, "schedule": every, "options": {"queue": "control", "expires": every * 0.9}}

    return {
        "reconcile": entry("llmgw.reconcile", settings.reconcile_interval),
        "publish": entry("llmgw.publish", settings.publish_interval),
        "housekeeping": entry("llmgw.housekeeping", HOUSEKEEPING_INTERVAL),
    }
