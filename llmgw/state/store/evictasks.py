"""The asks of waiting requests for another gateway's slot, and their claims (gateway.routing.remote_eviction,
gateway.server.remote_evictions): one round trip per look, and one more to claim an ask."""

from __future__ import annotations

from typing import Iterable, Mapping

from llmgw.state import keys
from llmgw.state.store.base import Aggregate, ms

ASKS_KEEP = 5.0  # seconds a model's asks hash lives after its last write (an ask is refreshed far more often)
CLAIM_KEEP = 5.0  # seconds a claim lives: long past the asker's read of it


class EvictAsks(Aggregate):
    def exchange_evict_asks(self, asker: str, post: Mapping[str, str], withdraw: Iterable[str],
                            read: Iterable[str], claims: Iterable[tuple[str, int]]
                            ) -> tuple[dict[str, dict[str, str]], dict[tuple[str, int], str]]:
        """Post `asker`'s asks (model -> encoded ask), take back its asks for `withdraw`, read every
        worker's asks for the models in `read`, and read the claims on `asker`'s asks `claims` (model,
        seq): all in one round trip. Returns (asks per model: asker -> encoded; the claims made: (model,
        seq) -> the victim's endpoint)."""
        read, claims = sorted(set(read)), list(claims)
        pipe = self.r.pipeline(transaction=False)
        for model, raw in post.items():
            pipe.hset(keys.evict_asks(model), asker, raw)
            pipe.pexpire(keys.evict_asks(model), ms(ASKS_KEEP))
        for model in withdraw:
            pipe.hdel(keys.evict_asks(model), asker)
        for model in read:
            pipe.hgetall(keys.evict_asks(model))
        for model, seq in claims:
            pipe.get(keys.evict_claim(asker, model, seq))
        out = pipe.execute()
        got = out[len(out) - len(read) - len(claims):]
        asks = {model: raw or {} for model, raw in zip(read, got[:len(read)])}
        made = {c: v for c, v in zip(claims, got[len(read):]) if v is not None}
        return asks, made

    def claim_evict_ask(self, asker: str, model: str, seq: int, endpoint: str) -> bool:
        """Claim `asker`'s ask `seq` for `model`, naming the endpoint whose slot it gets: True for the
        one worker that claims it first."""
        return bool(self.r.set(keys.evict_claim(asker, model, seq), endpoint, nx=True, px=ms(CLAIM_KEEP)))
