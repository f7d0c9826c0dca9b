"""llmgw's Celery workers: the control queue and the per-node agents. `celery -A workers ...`."""

from llmgw.settings import ControlSettings
from workers.celery_app import create_celery_app

app = create_celery_app(ControlSettings.from_env())

__all__ = ["app"]
