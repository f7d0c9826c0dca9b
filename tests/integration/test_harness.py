"""The test harness itself: a real cluster comes up, and a leaked process is caught."""

import subprocess
import sys

from harness.procs import processes_with_token, wait_until


def test_cluster_processes_come_up_and_stop(cluster, no_leaked_processes):
    cluster.start_redis()
    cluster.start_control()
    cluster.start_beat()
    cluster.start_node("a")
    cluster.start_gateway()
    wait_until(lambda: all(p.alive() for p in cluster.procs.procs) and len(processes_with_token(no_leaked_processes)) >= 5,
               20, what="every process to be running")
    cluster.stop()
    assert not any(p.alive() for p in cluster.procs.procs)


def test_leak_detector_sees_a_stray_process(no_leaked_processes):
    stray = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        wait_until(lambda: stray.pid in processes_with_token(no_leaked_processes), 5, what="the stray to be seen")
    finally:
        stray.kill()
        stray.wait()
