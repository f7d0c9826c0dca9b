"""Open-loop load generators shared by the routing test, bench/routing.py and bench/fleetsim.py.

- `paced`: calls a function at an even rate from a thread pool (small loads in tests).
- `poisson_times`: seeded Poisson arrival times whose rate may change over time (a burst).
- `open_loop_streams`: sends streamed chat requests at given times from one asyncio loop, so
  thousands can be open at once, and times each one (first content token, end) on the client side.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence
from urllib.parse import urlsplit


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


def poisson_times(rate_at: Callable[[float], float], peak: float, seconds: float, seed: int) -> list[float]:
    """Arrival times in [0, seconds) of a Poisson process with rate `rate_at(t)` <= `peak`, by thinning
    a process at the peak rate: the same seed gives the same candidates whatever the rate shape."""
    rng = random.Random(seed)
    t, out = 0.0, []
    while True:
        t += rng.expovariate(peak)
        if t >= seconds:
            return out
        if rng.random() * peak < rate_at(t):
            out.append(t)


@dataclass(frozen=True)
class StreamResult:
    at: float  # when it was sent, seconds from the start of the run
    status: int  # HTTP status; 0 when the connection failed or timed out
    ttft: float | None  # seconds to the first chunk carrying content
    latency: float  # seconds to the end of the answer (or the failure)
    server: str = ""  # the first `system_fingerprint` seen in the stream (which engine answered)


_FINGERPRINT = re.compile(rb'"system_fingerprint": ?"([^"]+)"')
_CONTENT = re.compile(rb'"(?:content|text)": ?"(?!")')  # a token: a non-empty content string


async def _one(host: str, port: int, path: str, body: bytes, at: float, timeout: float) -> StreamResult:
    start = time.monotonic()
    status, ttft, server = 0, None, ""
    writer = None
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\nAccept: text/event-stream\r\n"
                         b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
                         % (path.encode(), host.encode(), port, len(body), body))
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            tail = b""
            # The body is read as it comes (chunked or not, until the server closes): only the
            # first token and the fingerprint are looked for, across chunk boundaries.
            while chunk := await reader.read(65536):
                if ttft is None or not server:
                    seen = tail + chunk
                    if ttft is None and _CONTENT.search(seen):
                        ttft = time.monotonic() - start
                    if not server and (m := _FINGERPRINT.search(seen)):
                        server = m.group(1).decode()
                    tail = seen[-256:]
    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError, IndexError):
        status = 0 if status == 200 else status
    finally:
        if writer is not None:
            writer.close()
    return StreamResult(at, status, ttft, time.monotonic() - start, server)


def open_loop_streams(url: str, path: str, bodies: Sequence[bytes], times: Sequence[float],
                      timeout: float = 300.0, until: Callable[[], bool] | None = None) -> list[StreamResult]:
    """POST `bodies[i]` to `url + path` at `times[i]` seconds from now (an open loop: a slow answer
    never delays the next arrival), each on its own connection; wait for every answer. `until`: no
    more arrivals once it says True (checked at each arrival)."""
    u = urlsplit(url)
    host, port = u.hostname or "127.0.0.1", u.port or 80

    async def run() -> list[StreamResult]:
        t0 = time.monotonic()
        tasks = []
        for at, body in zip(times, bodies):
            delay = t0 + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if until is not None and until():
                break
            tasks.append(asyncio.create_task(_one(host, port, path, body, at, timeout)))
        return list(await asyncio.gather(*tasks))

    return asyncio.run(run())
