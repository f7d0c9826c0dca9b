"""The Celery app factory. `celery -A workers` finds the instance built in workers/__init__.py.

Queues: `control` runs the reconciler, placement and publishing; each machine's agent consumes
`node-<name>` (launch/stop for the replicas placed there); `batch` feeds the Batch API's lines
(workers/batch/, docs/batch.md). Tasks are short and idempotent; long
supervision lives in the agent loop inside the node worker (workers/agent/step.py).
"""

from __future__ import annotations

from celery import Celery

from beat.schedule import beat_schedule
from llmgw.redisurl import celery_conf, parse
from llmgw.settings import ControlSettings
from llmgw.state.keys import BATCH_QUEUE, CONTROL_QUEUE
from workers.broker import install as install_sentinel_transport


class LlmgwCelery(Celery):
    """A Celery app that carries the control plane's settings, read once from the environment (a node
    worker's agent reads its own, `AgentSettings`, when it starts)."""

    settings: ControlSettings


def create_celery_app(settings: ControlSettings) -> LlmgwCelery:
    # The broker is the Redis every part shares; a Sentinel URL becomes Celery's `sentinel://` transport
    # with the master's name (llmgw.redisurl.celery_conf), so workers, beat and Flower follow a failover.
    broker = celery_conf(settings.redis_url)
    if parse(settings.redis_url).sentinel:
        install_sentinel_transport()  # kombu's, repaired to survive a failover (workers/broker.py)
    app = LlmgwCelery(
        "llmgw",
        broker=broker.pop("broker_url"),
        include=["workers.control.tasks", "workers.agent.tasks", "workers.batch.tasks"],
    )
    app.settings = settings
    app.conf.update(**broker)
    app.conf.update(
        task_default_queue=CONTROL_QUEUE,
        task_routes={
            "llmgw.reconcile": {"queue": CONTROL_QUEUE},
            "llmgw.publish": {"queue": CONTROL_QUEUE},
            "llmgw.housekeeping": {"queue": CONTROL_QUEUE},
            "llmgw.external": {"queue": CONTROL_QUEUE},
            "llmgw.batch.*": {"queue": BATCH_QUEUE},
        },
        task_ignore_result=True,
        task_acks_late=False,  # a redelivered control task is harmless, but don't invite it
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        # Unacked tasks come back after this; our tasks take milliseconds.
        broker_transport_options={**broker.get("broker_transport_options", {}), "visibility_timeout": 300},
        worker_send_task_events=True,  # for Flower
        task_send_sent_event=True,
        beat_schedule=beat_schedule(settings),
        timezone="UTC",
        enable_utc=True,
    )
    # The node agent's supervision loop runs inside a worker that consumes a node-<name> queue.
    from workers.agent.step import AgentStep

    app.steps["worker"].add(AgentStep)
    return app
