"""Node-queue tasks (stub until the agent lands)."""

from celery import shared_task


@shared_task(name="llmgw.launch")
def launch(replica_id: str) -> None:
    pass


@shared_task(name="llmgw.stop")
def stop(replica_id: str) -> None:
    pass
