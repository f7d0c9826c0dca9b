"""Control-queue tasks (stub until the control plane lands)."""

from celery import shared_task


@shared_task(name="llmgw.reconcile")
def reconcile() -> None:
    pass


@shared_task(name="llmgw.publish")
def publish() -> None:
    pass


@shared_task(name="llmgw.housekeeping")
def housekeeping() -> None:
    pass
