"""Per-key policy: the pure decision `gateway.keys.policy.decide`, the budget periods, and the flags of
`llmgw keys create|update` that set them."""

from datetime import datetime, timezone

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.keys.policy import ALLOW, Deny, ModelRef, decide
from llmgw.state.keypolicy import ApiKeyInvalid, ApiKeyRecord, parse_expires, parse_models, parse_tokens
from llmgw.state.budget import iso, period_of


def ts(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=timezone.utc).timestamp()


NOW = ts("2026-03-14T15:09:26")  # a Saturday afternoon, UTC
M = ModelRef("m-alias", frozenset({"m", "m-alias"}))  # asked by its alias
OTHER = ModelRef("other", frozenset({"other"}))


def key(**kw) -> ApiKeyRecord:
    return ApiKeyRecord("k-1", "team-a", "h", **kw)


# (key fields, model, tokens used this period, expected: ALLOW or (kind, message part, retry_after))
TABLE = [
    ({}, M, 0, ALLOW),
    ({}, None, 0, ALLOW),
    # models: names or aliases on either side; others do not exist for this key
    ({"models": ("m",)}, M, 0, ALLOW),
    ({"models": ("m-alias",)}, ModelRef("m", frozenset({"m", "m-alias"})), 0, ALLOW),
    ({"models": ("m",)}, OTHER, 0, ("model_not_found", "model 'other' does not exist", None)),
    ({"models": ("a", "b")}, M, 0, ("model_not_found", "model 'm-alias' does not exist", None)),
    ({"models": ("m",)}, None, 0, ALLOW),  # listing models is about no model
    # expiry: at the instant itself the key is expired; it beats every other answer
    ({"expires_at": NOW + 1}, M, 0, ALLOW),
    ({"expires_at": NOW}, M, 0, ("key_expired", "API key team-a expired at 2026-03-14T15:09:26Z", None)),
    ({"expires_at": NOW - 5, "models": ("x",)}, M, 0, ("key_expired", "expired at", None)),
    ({"expires_at": NOW - 5}, None, 0, ("key_expired", "expired at", None)),
    ({"expires_at": NOW - 5, "budget": 10, "budget_period": "day"}, M, 99, ("key_expired", "expired", None)),
    # budgets: admitted while below; at or past it, 429 until the UTC period ends
    ({"budget": 100, "budget_period": "day"}, M, 99, ALLOW),
    ({"budget": 100, "budget_period": "day"}, M, 100,
     ("budget_exceeded", "spent 100 of its 100 tokens this day (UTC); the budget resets at 2026-03-15T00:00:00Z",
      ts("2026-03-15T00:00:00") - NOW)),
    ({"budget": 100, "budget_period": "month"}, M, 250,
     ("budget_exceeded", "resets at 2026-04-01T00:00:00Z", ts("2026-04-01T00:00:00") - NOW)),
    ({"budget": 100, "budget_period": "month"}, None, 250, ALLOW),  # reading usage is never over budget
    ({"budget": 100, "budget_period": "day", "models": ("m",)}, OTHER, 250,
     ("model_not_found", "does not exist", None)),  # a model it may not call does not exist, budget or not
]


@pytest.mark.parametrize("fields, model, used, expected", TABLE)
def test_decision_table(fields, model, used, expected):
    got = decide(key(**fields), model, used, NOW)
    if expected is ALLOW:
        assert got == ALLOW
        return
    kind, part, retry = expected
    assert isinstance(got, Deny) and got.kind == kind and part in got.message, got
    assert got.retry_after == (None if retry is None else int(retry) + (retry % 1 > 0))


def test_retry_after_is_at_least_a_second():
    end = ts("2026-03-15T00:00:00")
    got = decide(key(budget=1, budget_period="day"), M, 1, end - 0.2)
    assert isinstance(got, Deny) and got.retry_after == 1
    assert decide(key(budget=1, budget_period="day"), M, 0, end) == ALLOW  # a new day, a new count


@pytest.mark.parametrize("kind, at, pid, start, end", [
    ("day", "2026-03-14T15:09:26", "2026-03-14", "2026-03-14T00:00:00", "2026-03-15T00:00:00"),
    ("day", "2026-12-31T23:59:59", "2026-12-31", "2026-12-31T00:00:00", "2027-01-01T00:00:00"),
    ("month", "2026-02-28T10:00:00", "2026-02", "2026-02-01T00:00:00", "2026-03-01T00:00:00"),
    ("month", "2026-12-31T23:59:59", "2026-12", "2026-12-01T00:00:00", "2027-01-01T00:00:00"),
])
def test_periods_are_utc_calendar_days_and_months(kind, at, pid, start, end):
    p = period_of(kind, ts(at))
    assert (p.id, p.start, p.end) == (pid, ts(start), ts(end))
    assert iso(p.end) == end + "Z"


@pytest.mark.parametrize("text, seconds", [("30d", 30 * 86400), ("12h", 12 * 3600), ("2 s", 2), ("1.5m", 90),
                                           ("2w", 14 * 86400)])
def test_expires_as_a_duration(text, seconds):
    assert parse_expires(text, NOW) == NOW + seconds


@pytest.mark.parametrize("text, at", [("2026-12-31", "2026-12-31T00:00:00"),
                                      ("2026-12-31T12:30:00", "2026-12-31T12:30:00"),
                                      ("2026-12-31T12:30:00+02:00", "2026-12-31T10:30:00"),
                                      ("2026-12-31T12:30:00Z", "2026-12-31T12:30:00")])
def test_expires_as_a_date(text, at):
    assert parse_expires(text, NOW) == ts(at)


@pytest.mark.parametrize("text, why", [("soon", "expected a duration"), ("2020-01-01", "not in the future"),
                                       ("0s", "not in the future"), ("-3d", "expected a duration")])
def test_bad_expiry_names_the_flag(text, why):
    with pytest.raises(ApiKeyInvalid, match=f"--expires: .*{why}"):
        parse_expires(text, NOW)


@pytest.mark.parametrize("text, n", [("5M", 5_000_000), ("250k", 250_000), ("100000", 100_000), ("1.5m", 1_500_000),
                                     ("2G", 2_000_000_000)])
def test_budget_tokens(text, n):
    assert parse_tokens(text) == n


@pytest.mark.parametrize("text", ["lots", "5T", "0", "-1k", ""])
def test_bad_budget_names_the_flag(text):
    with pytest.raises(ApiKeyInvalid, match="--budget"):
        parse_tokens(text)


def test_models_flag():
    assert parse_models("a, b,a") == ("a", "b")
    assert parse_models("all") == () and parse_models("") == ()
    with pytest.raises(ApiKeyInvalid, match="--models"):
        parse_models("a,,b")


def test_policy_round_trips_through_the_stored_json():
    rec = key(models=("m", "x"), expires_at=NOW, budget=5, budget_period="day", admin=True)
    assert ApiKeyRecord.from_json(rec.id, rec.to_json()) == rec
    # records written before the policy fields existed read as "every model, forever, no budget"
    old = ApiKeyRecord.from_json("k-2", '{"name": "old", "hash": "h", "rpm": 3}')
    assert (old.models, old.expires_at, old.budget, old.budget_period, old.admin) == ((), None, None, None, False)
    with pytest.raises(ValueError, match="budget_period"):
        ApiKeyRecord.from_json("k-3", '{"hash": "h", "budget": 5, "budget_period": "week"}')
    with pytest.raises(ValueError, match="models"):
        ApiKeyRecord.from_json("k-4", '{"hash": "h", "models": "m"}')


@given(st.integers(min_value=0, max_value=4_102_444_800_000))  # 1970 .. 2100, in milliseconds
def test_periods_agree_with_the_calendar(ms):
    now = ms / 1000  # (datetime rounds sub-microsecond times up to the next day; the period must not)
    t = datetime.fromtimestamp(now, timezone.utc)
    day, month = period_of("day", now), period_of("month", now)
    assert day.id == t.strftime("%Y-%m-%d") and day.start <= now < day.end
    assert month.id == t.strftime("%Y-%m") and month.start <= now < month.end
    assert datetime.fromtimestamp(month.start, timezone.utc).day == 1 == datetime.fromtimestamp(month.end, timezone.utc).day
    assert period_of("day", day.end).start == day.end and period_of("month", month.end).start == month.end
