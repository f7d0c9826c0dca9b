"""What `llmgw batches` and the console show of a batch: one row, with its progress and its rate (lines
answered per second over the feeder's last samples) and, while it runs, when it should end. Pure."""

from __future__ import annotations

from llmgw.state.batch_records import ANONYMOUS_OWNER, BatchRecord

RATE_WINDOW = 60.0  # seconds of progress samples the rate is taken over


def rate(progress: list[list[float]], window: float = RATE_WINDOW) -> float | None:
    """Lines answered per second between the oldest sample within `window` of the newest and the newest;
    None with fewer than two samples."""
    if len(progress) < 2:
        return None
    t1, n1 = progress[-1]
    first = next((p for p in progress if t1 - p[0] <= window), progress[-2])
    t0, n0 = first
    if t1 <= t0:
        return None
    return max(0.0, (n1 - n0) / (t1 - t0))


def batch_row(b: BatchRecord, owners: dict[str, str], now: float) -> dict:
    """One batch as a row: `owners` maps key ids to names (a revoked key shows its id)."""
    r = rate(b.progress) if not b.ended else None
    left = b.total - b.done
    return {
        "id": b.id, "owner": owners.get(b.owner, b.owner if b.owner == ANONYMOUS_OWNER else b.owner + " (revoked)"),
        "model": b.model, "endpoint": b.endpoint, "status": b.status, "total": b.total,
        "completed": b.n_completed, "failed": b.n_failed, "done": b.done,
        "progress": round(b.done / b.total, 4) if b.total else 1.0,
        "rate": None if r is None else round(r, 2),
        "eta_seconds": round(left / r) if r and left > 0 and not b.ended else None,
        "created_at": b.created_at, "expires_in": None if b.ended else max(0.0, round(b.expires_at - now, 1)),
        "tokens": b.prompt_tokens + b.completion_tokens,
        "output_file_id": b.output_file_id, "error_file_id": b.error_file_id,
    }
