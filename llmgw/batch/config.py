"""The Batch API's settings (`LLMGW_BATCH_*`), read once at start-up by the gateways (the file and batch
limits) and the batch workers (everything else); docs/batch.md has the table."""

from __future__ import annotations

from typing import ClassVar

from llmgw.settings import Seconds, Settings, env

MiB = 1024 * 1024


class BatchSettings(Settings):
    docs: ClassVar[str] = "docs/batch.md"

    max_file_bytes: int = env("LLMGW_BATCH_MAX_FILE_BYTES", default=64 * MiB, ge=1,
                              meaning="the largest batch input file a gateway stores (in Redis, in chunks); a larger "
                                      "upload gets 413 and nothing is kept")
    max_requests: int = env("LLMGW_BATCH_MAX_REQUESTS", default=50_000, ge=1,
                            meaning="requests (lines) one input file may hold, as OpenAI's Batch API allows")
    max_line_bytes: int = env("LLMGW_BATCH_MAX_LINE_BYTES", default=MiB, ge=64,
                              meaning="the longest line of an input file (one request)")
    gateway_url: str = env("LLMGW_BATCH_GATEWAY_URL", default="http://127.0.0.1:8080",
                           meaning="where the batch workers send the lines: a gateway (or the load balancer in "
                                   "front of the gateways)")
    reserve: float = env("LLMGW_BATCH_RESERVE", default=0.2, ge=0, lt=1,
                         meaning="the share of each endpoint's `capacity` the batch tier leaves to interactive "
                                 "requests: lines are sent only while an endpoint holds less than (1 - reserve) x capacity")
    max_inflight: int = env("LLMGW_BATCH_MAX_INFLIGHT", default=64, ge=1, le=4096,
                            meaning="lines one run task has in flight at most (one thread each)")
    view_interval: Seconds = env("LLMGW_BATCH_VIEW_INTERVAL", default=0.5, gt=0,
                                 meaning="seconds between a feeder's reads of the fleet's load (how much room is left)")
    slice_seconds: Seconds = env("LLMGW_BATCH_SLICE", default=60.0, gt=0,
                                 meaning="seconds a run task feeds one batch before it hands it back to the queue "
                                         "(so more batches than worker threads take turns)")
    lease_ttl: Seconds = env("LLMGW_BATCH_LEASE_TTL", default=5.0, gt=0,
                             meaning="seconds a run task's hold on a batch outlives it: a killed worker's batch is "
                                     "taken over this long after (plus a sweep)")
    sweep_interval: Seconds = env("LLMGW_BATCH_SWEEP_INTERVAL", default=2.0, gt=0,
                                  meaning="beat schedule of `llmgw.batch.sweep`, which sends a run task for every "
                                          "unfinished batch that nobody feeds")
    retries: int = env("LLMGW_BATCH_RETRIES", default=5, ge=0, le=100,
                       meaning="further tries of a line whose answer was a server error (5xx) or none at all; a "
                               "line shed by admission (429) is tried again until the batch expires")
    request_timeout: Seconds = env("LLMGW_BATCH_REQUEST_TIMEOUT", default=600.0, gt=0,
                                   meaning="seconds one line's request may take")
    drain_seconds: Seconds = env("LLMGW_BATCH_DRAIN", default=30.0, ge=0,
                                 meaning="seconds a cancelled or expired batch waits for its lines in flight before "
                                         "it is sealed (answers after that are not kept)")
