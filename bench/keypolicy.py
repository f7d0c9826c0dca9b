"""What a key's policy costs the request path: `KeyGate.enforce` (expiry, models, budget over the
in-memory tables, gateway.keys.policy.decide) per request, for an ordinary key and for one with every
policy set, next to the key lookup every keyed request already pays. In-process, on fakeredis (no
Redis is touched on this path); prints microseconds per call.

    python -m bench.keypolicy
"""

from __future__ import annotations

import time
import timeit

import fakeredis

from gateway.app import create_app
from gateway.config import GatewaySettings
from llmgw.state.records import EndpointInfo
from llmgw.state.store import Store

N = 100_000


def main() -> None:
    store = Store(fakeredis.FakeRedis(decode_responses=True))
    store.write_endpoints([EndpointInfo(id="e", url="http://127.0.0.1:1", models=("m", "m-alias"), engine="sim",
                                        model="m")], "fp", time.time())
    gw = create_app(GatewaySettings(), store=store).extensions["llmgw"]
    _, plain_key = store.create_key("plain")
    store.create_key("all-policies", models=("m",), expires_at=time.time() + 3600, budget=10**9,
                     budget_period="month")
    gw.refresh()
    plain, rich = gw.keys.find("plain"), gw.keys.find("all-policies")
    rows = [
        ("key lookup (SHA-256 of the presented key), already paid", lambda: gw.keys.lookup(plain_key)),
        ("enforce: key without policy", lambda: gw.gate.enforce(plain, "m-alias")),
        ("enforce: --models, --expires and --budget", lambda: gw.gate.enforce(rich, "m-alias")),
    ]
    for name, fn in rows:
        best = min(timeit.repeat(fn, number=N, repeat=5)) / N
        print(f"{name:58} {best * 1e6:6.2f} us")


if __name__ == "__main__":
    main()
