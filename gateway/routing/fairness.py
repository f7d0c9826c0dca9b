"""Who goes next when tenants share a saturated model: the Virtual Token Counter, pure.

The reference is VTC (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024). Each
tenant (an API key, `llmgw.state.keypolicy.Tenant`) has a counter of the service it received on a
model, in tokens divided by its key's weight: the prompt tokens its requests made the engine prefill
(less what the engine was expected to hold in its prefix cache) plus `output_weight` times the tokens
generated. When a slot frees, the waiting request of the tenant with the least counter goes next
(`next_of`); within a tenant, first come first served. A tenant that joins the queue while it had
nothing waiting is lifted to the least counter of the tenants that do (`floor`), or, when none does,
to the counter of the tenant served last, less one of its own requests (`lifted`): an idle tenant
banks no credit, and a light one is served next whatever the others have waiting. Nothing is held
back: a tenant alone gets the whole model.

A key marked `sub_tenants` splits its share the same way among the sub-tenants its front end names:
first the key with the least counter, then its sub-tenant with the least.

Counters are charged an estimate when a request is sent (`estimate`: the prompt as routing saw it,
the output from `max_tokens` and what the tenant's answers were lately) and corrected to what the
answer reports when it ends (`cost`). The counters themselves, shared by the gateways through Redis,
are gateway.routing.ledger's; this module only decides.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping

# What `LLMGW_GATEWAY_FAIRNESS` may say: `tokens` (VTC, above) or `fcfs` (first come, first served,
# as before; the counters are still kept, for the metrics).
MODES = ("tokens", "fcfs")
BYTES_PER_TOKEN = 4.0  # a prompt's tokens from its body when routing did not count them
DEFAULT_OUTPUT = 256.0  # tokens a request is expected to generate before its tenant's answers said
LEARN_OUTPUT = 0.2  # weight of an answer's output tokens in its tenant's expected output


def prompt_estimate(prompt_tokens: float, body_bytes: int) -> float:
    """The prompt's tokens: as prefix routing counted them, else from the body's size."""
    return prompt_tokens if prompt_tokens > 0 else body_bytes / BYTES_PER_TOKEN


def output_estimate(max_tokens: object, learned: float | None, generates: bool) -> float:
    """Tokens the request is expected to generate: what its tenant's answers generated lately (else
    DEFAULT_OUTPUT), at most its `max_tokens`; none for an operation that generates nothing."""
    if not generates:
        return 0.0
    guess = learned if learned is not None else DEFAULT_OUTPUT
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens > 0:
        return min(guess, float(max_tokens))
    return guess


def cost(prefill_tokens: float, output_tokens: float, output_weight: float) -> float:
    """The service one request received: the prompt tokens the engine computed, plus the output
    tokens times `output_weight` (a generated token costs a decode step; VTC weighs it 2)."""
    return max(0.0, prefill_tokens) + output_weight * max(0.0, output_tokens)


def estimate(prompt: float, expected_cached: float, output: float, output_weight: float) -> float:
    """The cost charged when a request is sent, before its answer says what it was."""
    return cost(prompt - min(prompt, max(0.0, expected_cached)), output, output_weight)


def learn_output(learned: float | None, generated: int) -> float:
    """A tenant's expected output after one more answer that generated `generated` tokens."""
    return float(generated) if learned is None else learned + LEARN_OUTPUT * (generated - learned)


def floor(backlogged: Iterable[float], last_served: float | None) -> float | None:
    """What a tenant joining the queue is lifted to: the least counter of the tenants waiting, or
    when none waits, the counter of the tenant served last (None: nothing to lift to)."""
    least = min(backlogged, default=None)
    return least if least is not None else last_served


def lifted(counter: float, to: float | None, turn: float, idle: bool = False, level: float | None = None) -> float:
    """A joining tenant's counter: lifted to the floor `to` less one `turn` (what one of its requests
    costs, in counter units). The turn lets the first request of a tenant that had nothing waiting go
    next, ahead of the backlogs level with it: what the answers of the others' requests in flight add
    to their counters, and its own to its, is noise of about that size, and would otherwise put it
    behind a backlog as often as not. A tenant with requests waiting is never lifted, so it banks
    nothing: it gains one request's place each time it comes back from idle, as a tenant that sends
    less than its share should.

    A counter is not lowered, but for one case: `idle`, the tenant has nothing waiting and nothing
    running anywhere in the gateway, and stands no more than one turn above the floor. It was charged its last
    request when it sent it, while the others' running answers had been charged before it came, so it
    comes back level with the floor (a little above, by what its answer's usage corrected): level, it
    neither goes before their backlog nor outranks their running answers for eviction
    (gateway.routing.eviction), and waits for the next answer to end (`python -m bench.preempt`).
    Taken back to the floor less one turn, it gets the place the turn is for. A tenant further above
    the floor (served more than the others) is not: what it was served beyond one of its requests is
    never forgiven, and it is never more than one turn below the floor.

    `level` (default `to`) is the floor "within one turn" is judged by, when `to` comes partly from
    another view of the counters (the sibling workers' queue heads, whose view lags this one's by the
    charges not exchanged yet): the key is judged against its own worker's floor, and taken below the
    least of both."""
    if to is None:
        return counter
    near = to if level is None else level
    if idle and counter <= near + turn:
        return min(to, near) - turn
    return max(counter, to - turn)


def next_of(waiting: Iterable[tuple[str, float, int, int]], fcfs: bool = False) -> str | None:
    """Of the tenants waiting, (id, counter, requests waiting, arrival number of its oldest waiter),
    the one whose request goes next: the least counter; among equals (a tenant just lifted to the
    floor is level with the one it was lifted to) the one with fewer waiting, so a tenant that sends
    little goes before a backlog; then the oldest waiter. With `fcfs`, the oldest waiter."""
    best, best_key = None, None
    for tid, counter, n, seq in waiting:
        key = (seq,) if fcfs else (counter, n, seq)
        if best_key is None or key < best_key:
            best, best_key = tid, key
    return best


def fair_position(own_waiting: int, weight: float, waiting_weights: Iterable[float], queue_len: int,
                  fcfs: bool = False) -> int:
    """How many requests leave the queue until this tenant's new one does (1 = next): its tenant's
    own waiting requests and this one, each taking the turns of every waiting tenant's share (as
    requests, the tenants' weights together over its own), never more than the whole queue. What
    admission divides by the completion rate to judge whether it can be served within the bound:
    a light tenant behind a long backlog of another's is not refused for that backlog."""
    if fcfs:
        return queue_len + 1
    total = weight + sum(waiting_weights)
    return min(queue_len + 1, max(1, math.ceil((own_waiting + 1) * total / weight)))


def shares(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """Each tenant's share of the service a model gave between two readings of the totals."""
    got = {k: max(0.0, v - before.get(k, 0.0)) for k, v in after.items()}
    total = sum(got.values())
    return {k: v / total for k, v in got.items()} if total > 0 else {}
