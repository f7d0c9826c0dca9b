"""A key that isolates its prefix cache: the record's field (validated, read back, off by default)
and the salt its requests carry (`cache_salt_of`)."""

import json
import re

import pytest

from llmgw.state.keypolicy import ApiKeyInvalid, ApiKeyRecord, cache_salt_of, new_key, updated, validate_record


def key(kid="k-0001", hash_="a" * 64, isolate=True) -> ApiKeyRecord:
    return ApiKeyRecord(kid, "team", hash_, isolate_cache=isolate)


def test_off_by_default_and_read_back():
    rec, _ = new_key("team", None, None, None, 0.0, token=lambda n: "t" * n, hexid=lambda n: "0" * 2 * n)
    assert rec.isolate_cache is False and cache_salt_of(rec) is None
    on, _ = new_key("team", None, None, None, 0.0, isolate_cache=True)
    back = ApiKeyRecord.from_json(on.id, on.to_json())
    assert back == on and back.isolate_cache is True
    # a record written before the field existed, or with a value that is not `true`, shares its cache
    d = json.loads(on.to_json())
    del d["isolate_cache"]
    assert ApiKeyRecord.from_json(on.id, json.dumps(d)).isolate_cache is False
    assert ApiKeyRecord.from_json(on.id, json.dumps({**d, "isolate_cache": "yes"})).isolate_cache is False


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_a_record_to_store_must_say_true_or_false(value):
    with pytest.raises(ApiKeyInvalid, match="--isolate-cache: must be true or false"):
        validate_record(key(isolate=value))
    with pytest.raises(ApiKeyInvalid, match="--isolate-cache"):
        updated(key(isolate=False), {"isolate_cache": value})


@pytest.mark.parametrize("rec, salted", [
    (None, False),  # no key required: nothing to isolate
    (key(isolate=False), False),
    (key(isolate=True), True),
])
def test_only_an_isolating_key_has_a_salt(rec, salted):
    assert (cache_salt_of(rec) is not None) == salted


def test_the_salt_is_stable_per_key_and_differs_between_keys():
    a = cache_salt_of(key("k-0001", "a" * 64))
    assert a == cache_salt_of(key("k-0001", "a" * 64))  # every gateway process, every request
    assert a == cache_salt_of(updated(key("k-0001", "a" * 64), {"weight": 3.0}))  # a policy change keeps it
    assert a != cache_salt_of(key("k-0002", "a" * 64))
    # it takes the key's hash, which only Redis and the key's holder can make: another tenant who
    # knows the id cannot compute it
    assert a != cache_salt_of(key("k-0001", "b" * 64))


def test_the_salt_fits_vllm_and_reveals_nothing_of_the_key():
    rec = key("k-0001", "c0ffee" * 10 + "beef")
    salt = cache_salt_of(rec)
    # vLLM 0.32: a non-empty string of at most 128 characters without '@', '/', '\\' or NUL
    assert re.fullmatch(r"llmgw-[0-9a-f]{32}", salt)
    assert rec.hash[:8] not in salt and rec.id not in salt
