"""Engine credential generations: one hash, model (or every model) -> how often its engines'
secrets were rotated; a replica made at a lower generation is replaced by a rolling update."""

from __future__ import annotations

from typing import Iterator

from llmgw.state import keys
from llmgw.state.store.base import Aggregate, Pipeline


def queue_generations(pipe: Pipeline) -> None:
    pipe.hgetall(keys.ENGINE_CREDENTIALS)


def take_generations(replies: Iterator) -> dict[str, int]:
    out = {}
    for name, raw in next(replies).items():
        try:
            out[name] = int(raw)
        except ValueError:
            pass
    return out


class Credentials(Aggregate):
    def credential_generations(self) -> dict[str, int]:
        """Model (or `keys.ALL_MODELS`) -> how often its engine credentials were rotated."""
        pipe = self.r.pipeline(transaction=False)
        queue_generations(pipe)
        return take_generations(iter(pipe.execute()))

    def rotate_credentials(self, model: str | None) -> int:
        """Mark the replicas of `model` (None: every model) outdated: the next reconcile replaces them
        by a rolling update with fresh secrets. Returns the new generation of that name. Confirmed on the
        replicas `durability` asks for: a rotation a failover forgot would leave the old secrets in use."""
        return self.durably("the credential rotation",
                            lambda r: int(r.hincrby(keys.ENGINE_CREDENTIALS, model or keys.ALL_MODELS, 1)))
