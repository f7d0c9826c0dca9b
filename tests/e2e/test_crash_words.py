"""An engine killed by a signal is explained in words (issue 9): `llmgw status` names the signal,
what it means, and where the engine's log is, instead of "exited by signal 4"."""

from __future__ import annotations

import os
import signal
import time

import pytest

from llmgw.state.replica_state import State, derive
from harness.cluster import sim_catalog
from harness.procs import wait_until

pytestmark = pytest.mark.slow

CATALOG = sim_catalog(model="tiny")


def test_status_names_the_signal_and_the_engine_log(cluster):
    # A long backoff keeps the replica Failed (not restarted) while the test reads the status.
    cluster.start_system(CATALOG, node_env={"LLMGW_AGENT_BACKOFF_BASE": "60", "LLMGW_AGENT_BACKOFF_CAP": "60"},
                         gateways=0)
    store = cluster.store()

    def ready():
        recs = store.all_replicas()
        return recs and derive(recs[0], True, time.time()).state is State.READY and recs[0]

    rec = wait_until(ready, 60, what="the replica to be Ready")
    os.kill(rec.engine_pid, signal.SIGILL)  # what a binary built for another CPU dies of
    wait_until(lambda: derive(store.get_replica(rec.id), True, time.time()).state is State.FAILED, 30,
               what="the replica to be Failed")
    out = cluster.llmgw("status").stdout
    line = next(ln for ln in out.splitlines() if ln.startswith(rec.id))
    assert "Failed" in line
    assert "killed by SIGILL (illegal instruction: the engine binary uses CPU instructions this machine cannot run)" in line
    log_path = store.get_replica(rec.id).log_path
    assert log_path and log_path.endswith(f"{rec.id}/engine.log") and os.path.exists(log_path)
    assert f"engine log: a:{log_path}" in line
