"""The retry policy as a pure table: what happens after each outcome of each attempt."""

import pytest

from gateway.routing.retry import Deliver, GiveUp, Outcome, Retry, next_attempt


@pytest.mark.parametrize(
    "outcome, attempt, retries, expected",
    [
        (Outcome("answer", 200), 0, 2, Deliver()),
        (Outcome("answer", 404), 0, 2, Deliver()),  # the client's fault: never retried
        (Outcome("answer", 400), 1, 2, Deliver()),
        (Outcome("answer", 503), 0, 2, Retry("503")),
        (Outcome("answer", 500), 1, 2, Retry("500")),
        (Outcome("answer", 429), 0, 1, Retry("429")),
        (Outcome("answer", 503), 2, 2, Deliver()),  # last attempt: the engine's answer as it is
        (Outcome("answer", 429), 0, 0, Deliver()),
        (Outcome("connect_error"), 0, 2, Retry("connect")),
        (Outcome("connect_error"), 1, 2, Retry("connect")),
        (Outcome("connect_error"), 2, 2, GiveUp("no_replica")),
        (Outcome("connect_error"), 0, 0, GiveUp("no_replica")),
        (Outcome("timeout"), 0, 2, GiveUp("upstream_timeout")),  # the engine may still be working
    ],
)
def test_next_attempt_table(outcome, attempt, retries, expected):
    assert next_attempt(outcome, attempt, retries) == expected


def test_unknown_outcome_is_a_bug():
    with pytest.raises(ValueError):
        next_attempt(Outcome("weird"), 0, 2)
