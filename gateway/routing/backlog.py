"""The prompt work an endpoint has just been given and has likely not finished: its prefill backlog.

A request's first token waits for the prefills queued before it on its engine: the prompt tokens of
the requests sent there a moment ago that the engine's prefix cache did not hold. Both vLLM (chunked
prefill: waiting prompts are scheduled first come, first served within each step's token budget)
and llama.cpp (a batch computes every new prompt before the next token of anyone) work through them
before a newer prompt. The engine's scrape shows none of it (a second late, and only counts), and the
learned time to first byte is an average over all requests. So two idle endpoints look alike when one
of them has just been handed a 2,000-token miss; a request sent there waits for that prefill.

The backlog is a virtual clock per endpoint, as in fair queueing: each routed request pushes the
endpoint's "prefill done" time by the prefill seconds it still needs there (its prompt less what the
endpoint is expected to hold, at that endpoint's learned rate), starting from now when the backlog
had drained. `ahead(ep, now)` is what is left of it. It needs no signal from the engine and drains
by itself, so a wrong estimate is forgotten within seconds. The router keeps one (under its lock);
what the sibling workers sent (gateway.server.sentlog) is added to it as they learn of it.

A backlog is only ever the prefill of requests still held there: one whose answer ended (or whose
first byte came) is past its prefill, and so is everything sent before it. So where the gateway holds
nothing on an endpoint (its workers and the other gateways together), `choose` takes no backlog there
(gateway.routing.choice), and the next request sent there starts the clock afresh (`add(...,
idle=True)`). Without that, a prompt predicted at 14 s and served in 6 left 8 s of backlog on an idle
engine that held the conversation's history, and its next turn went to the other replica to prefill
the whole of it (tests/e2e/test_vllm_cpu.py, in CI).
"""

from __future__ import annotations

from typing import Iterable, Mapping


class PrefillBacklog:
    """Per endpoint, when (on the router's monotonic clock) its queued prefills are expected done."""

    __slots__ = ("done_at",)

    def __init__(self):
        self.done_at: dict[str, float] = {}

    def add(self, endpoint_id: str, seconds: float, now: float, idle: bool = False) -> None:
        """`seconds` of prefill were just sent to the endpoint; `idle`: it held nothing before (what was
        left of its clock had drained, however long it was predicted)."""
        if idle:
            self.done_at.pop(endpoint_id, None)
        if seconds > 0:
            self.done_at[endpoint_id] = max(self.done_at.get(endpoint_id, now), now) + seconds

    def ahead(self, endpoint_ids: Iterable[str], now: float) -> Mapping[str, float]:
        """Seconds of prefill still queued per endpoint (only the ones with some are listed)."""
        done = self.done_at
        return {i: t - now for i in endpoint_ids if (t := done.get(i, now)) > now}

    def keep(self, endpoint_ids: Iterable[str]) -> None:
        """Forget the endpoints no longer listed."""
        keep = set(endpoint_ids)
        for i in [i for i in self.done_at if i not in keep]:
            del self.done_at[i]
