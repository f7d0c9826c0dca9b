"""llmgw's Celery workers: the control queue and the per-node agents. `celery -A workers ...`."""

from llmgw.config import Settings
from workers.celery_app import create_celery_app

app = create_celery_app(Settings.from_env())

__all__ = ["app"]
