"""The install check's message: how the engine ended, what it means, what to do, its last output."""

import signal

from llmgw.engines.selfcheck import Failure, failure_message


def test_sigill_names_the_signal_the_floor_and_the_fix():
    msg = failure_message("/x/llama-server", Failure("waiting for /health", exit_signal=int(signal.SIGILL),
                                                     output_tail="load_tensors: done"))
    first, advice, *rest = msg.splitlines()
    assert first == ("llama-server (/x/llama-server) failed the install check while waiting for /health: killed "
                     "by SIGILL (illegal instruction: the engine binary uses CPU instructions this machine "
                     "cannot run)")
    assert "AVX2" in advice and "make clean-engine install" in advice and "LLMGW_LLAMA_SERVER" in advice
    assert rest == ["last lines of its output:", "  load_tensors: done"]


def test_sigkill_points_at_memory():
    msg = failure_message("b", Failure("answering a one-token completion", exit_signal=int(signal.SIGKILL)))
    assert "killed by SIGKILL (often out of memory" in msg and "Free some memory" in msg


def test_a_hang_has_no_exit_status_and_the_generic_advice():
    msg = failure_message("b", Failure("waiting for /health", "no 200 from http://127.0.0.1:1/health within 5 s"),
                          task="the benchmark")
    assert msg.splitlines()[:2] == ["llama-server (b) failed the benchmark while waiting for /health",
                                    "no 200 from http://127.0.0.1:1/health within 5 s"]
    assert "killed" not in msg and "exited" not in msg and "make clean-engine install" in msg


def test_an_exit_code_is_reported_as_such():
    assert "exited with code 127" in failure_message("b", Failure("waiting for /health", exit_code=127))
