"""An open-loop load generator shared by the routing test and bench/routing.py."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable


def paced(one: Callable[[], None], rate: float, seconds: float, max_workers: int = 96) -> None:
    """Call `one` `rate` times a second, evenly paced, for `seconds` (an open loop: slow answers do not
    slow the arrivals, as with real users); wait for every call and re-raise the first failure."""
    n = int(rate * seconds)
    with ThreadPoolExecutor(max_workers=max_workers) as pool:
        start = time.monotonic()
        futs = []
        for i in range(n):
            delay = start + i / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            futs.append(pool.submit(one))
        for f in futs:
            f.result()
