"""Hostile catalogs (issue 15, bad input): a YAML bomb, a 50 MB file, deep nesting, wrong types
everywhere, bytes that are not UTF-8. Each is refused with a precise error, by `llmgw catalog apply`
(exit 1, no traceback) and by `llmgw.catalog.load`, and Redis is left exactly as it was.

Nothing here times the refusal (the suite asserts no speeds); a bomb of nine levels of nine aliases
(387 million nodes once expanded) simply never finishes, nor fits in memory, unless it is refused
before anything walks its expansion, and the test's timeout fails it.
"""

from __future__ import annotations

import time

import pytest

from llmgw.catalog import load_catalog_file
from llmgw.errors import CatalogInvalid
from tests.faults.fleet import catalog

pytestmark = [pytest.mark.faults, pytest.mark.slow]


def bomb(levels: int = 9) -> bytes:
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return ("\n".join(lines) + f"\nmodels: *a{levels - 1}\n").encode()


def big() -> bytes:
    """50 MB of a plausible catalog: one model, then a very long list of profiles."""
    head = b"models:\n  - name: m\n    profiles:\n"
    one = b"      - {name: p, engine: sim, replicas: 1, args: [\"--seed\", \"1234567890\"]}\n"
    return head + one * (50 * 2**20 // len(one))


WRONG_TYPES = b"""
defaults: 7
models:
  - name: [not, a, string]
    aliases: {a: b}
    profiles:
      - name: 12
        engine: {sim: true}
        replicas: many
        gpu: {class: 5, count: lots}
        capacity: -3
        args: "--one-string"
        env: [A=1]
        drain_timeout: soon
"""

CASES = {
    # name: (file bytes, what the error must say)
    "yaml bomb": (bomb(), "expands to more than 200,000 YAML nodes through its aliases"),
    "50 MB": (big(), "a catalog may be at most 8,388,608 bytes"),
    "deep nesting": (b"models: " + b"[" * 100_000 + b"]" * 100_000 + b"\n", "exceeded maximum nesting depth"),
    "deep mappings": (b"models:\n" + b"".join(b"  " * i + b"k%d:\n" % i for i in range(1500)),
                      "exceeded maximum nesting depth"),
    "wrong types": (WRONG_TYPES, "models[0].name: must be a string"),
    "not UTF-8": (catalog().encode().replace(b"name: chat", b"name: ch\xffat"),
                  "is not UTF-8 text: byte 0xff at offset"),
    "latin-1": ("models:\n  - name: café\n    profiles: []\n".encode("latin-1"), "byte 0xe9 at offset 21 (line 2)"),
}


@pytest.fixture
def applied(cluster):
    """A Redis holding an applied catalog: what every refusal must leave untouched."""
    cluster.start_redis()
    cluster.apply_catalog(catalog())
    return cluster


def dump(r) -> dict[str, bytes | None]:
    """Every key: its value for those without an expiry, None for short-lived marks (a kick's)."""
    return {k: r.dump(k) if r.pttl(k) < 0 else None for k in sorted(r.keys("*"))}


def unchanged(before: dict, after: dict) -> bool:
    """Nothing new and nothing lasting changed (short-lived marks may have expired meanwhile)."""
    return set(after) <= set(before) and all(after[k] == before[k] for k in after)


@pytest.mark.parametrize("case", sorted(CASES))
def test_refused_precisely_and_nothing_changes(applied, tmp_path, case):
    data, says = CASES[case]
    path = tmp_path / "bad.yaml"
    path.write_bytes(data)
    r = applied.redis()
    before = dump(r)

    t = time.monotonic()
    with pytest.raises(CatalogInvalid) as e:
        load_catalog_file(path)
    loaded_in = time.monotonic() - t
    assert says in str(e.value), str(e.value)[:500]

    for command in (("catalog", "validate"), ("catalog", "apply"), ("catalog", "apply", "--dry-run")):
        t = time.monotonic()
        out = applied.llmgw(*command, str(path), check=False)
        took = time.monotonic() - t
        assert out.returncode == 2, (command, out.returncode, out.stderr[-500:])
        assert says in out.stderr and "Traceback" not in out.stderr, out.stderr[-800:]
        assert str(path) in out.stderr  # which file, and where in it
    assert unchanged(before, dump(r)), "a refused catalog changed Redis"
    print(f"{case}: {len(data):,} bytes refused by llmgw.catalog.load in {loaded_in:.2f}s, by the CLI in "
          f"{took:.2f}s: {says}")
