"""The words for how an engine ended: signals by name and meaning, codes as numbers."""

import signal

import pytest

from llmgw.proc.exitstatus import describe_exit, signal_name


@pytest.mark.parametrize("sig, words", [
    (signal.SIGILL, "killed by SIGILL (illegal instruction: the engine binary uses CPU instructions this "
                    "machine cannot run)"),
    (signal.SIGKILL, "killed by SIGKILL (often out of memory"),
    (signal.SIGSEGV, "killed by SIGSEGV (segmentation fault"),
    (signal.SIGABRT, "killed by SIGABRT (aborted"),
    (signal.SIGBUS, "killed by SIGBUS (bus error"),
    (signal.SIGFPE, "killed by SIGFPE (arithmetic error"),
    (signal.SIGTERM, "killed by SIGTERM (asked to stop)"),
])
def test_common_signals_are_named_and_explained(sig, words):
    assert describe_exit(None, int(sig)).startswith(words)


def test_other_signals_are_named_without_a_guess():
    assert describe_exit(None, int(signal.SIGUSR1)) == "killed by SIGUSR1"
    assert describe_exit(None, 77) == "killed by signal 77"
    assert signal_name(77) == "signal 77"


def test_a_signal_wins_over_the_code_recorded_with_it():
    # The agent's shim records a signal death as (exit_code=-sig, exit_signal=sig).
    assert describe_exit(-4, 4).startswith("killed by SIGILL (")


def test_a_negative_code_alone_is_popens_way_of_saying_signal():
    assert describe_exit(-11, None).startswith("killed by SIGSEGV (")


def test_exit_codes():
    assert describe_exit(1, None) == "exited with code 1"
    assert describe_exit(0, None) == "exited with code 0"
    assert describe_exit(0, 0) == "exited with code 0"


def test_nothing_known():
    assert describe_exit(None, None) == "exit status unknown"
