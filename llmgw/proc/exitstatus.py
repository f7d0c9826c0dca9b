"""How a process ended, in words a user can act on: `describe_exit(exit_code, exit_signal)`.

A record of an engine's exit holds numbers (`exit_signal=4`); a person needs "killed by SIGILL
(illegal instruction: ...)". One pure function owns that wording, so the install check, `llmgw status`,
`llmgw up` and the agent's log say the same thing about the same exit.
"""

from __future__ import annotations

import signal

# What the signals an engine typically dies of mean for the person reading about it. Others are
# named without an explanation ("killed by SIGUSR1").
_MEANINGS = {
    signal.SIGILL: "illegal instruction: the engine binary uses CPU instructions this machine cannot run",
    signal.SIGKILL: "often out of memory: the kernel's OOM killer sends it, as does a stop that waited too long",
    signal.SIGSEGV: "segmentation fault: the engine accessed memory it does not own, a bug in the engine "
                    "or one of its libraries",
    signal.SIGABRT: "aborted: the engine stopped itself on an internal error; the end of its log says which",
    signal.SIGBUS: "bus error: a memory access failed, often a memory-mapped model file that was truncated "
                   "or changed while in use",
    signal.SIGFPE: "arithmetic error, such as an integer division by zero, in the engine",
    signal.SIGTERM: "asked to stop",
    signal.SIGINT: "interrupted",
}


def signal_name(sig: int) -> str:
    """`SIGILL` for 4; `signal 77` for a number this platform has no name for."""
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def describe_exit(exit_code: int | None, exit_signal: int | None) -> str:
    """`killed by SIGILL (illegal instruction: ...)`, `exited with code 1`, or `exit status unknown`.

    A signal wins over a code: records keep both, and a signal-killed child's code is the negative
    signal number (Popen's returncode), which is also read as that signal when no signal is given.
    """
    if not exit_signal and exit_code is not None and exit_code < 0:
        exit_signal = -exit_code
    if exit_signal:
        meaning = _MEANINGS.get(exit_signal)
        name = signal_name(exit_signal)
        return f"killed by {name} ({meaning})" if meaning else f"killed by {name}"
    if exit_code is not None:
        return f"exited with code {exit_code}"
    return "exit status unknown"
