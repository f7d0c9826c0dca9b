"""The bootstep that runs the node agent inside a node worker (stub until the agent lands)."""

from celery import bootsteps


class AgentStep(bootsteps.StartStopStep):
    requires = {"celery.worker.components:Timer"}
