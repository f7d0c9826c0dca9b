"""Prove that llama-server runs on this machine: `python -m llmgw.engines.selfcheck [--binary PATH]`;
or, with `--vllm DIR`, that the vLLM CPU environment `make vllm` prepared in DIR serves its model.

`make install` runs it right after installing the engine, so a binary this machine cannot run (built
for other CPU instructions, a missing library) fails the install with an explanation instead of
surfacing minutes later as a replica in CrashLoop. It starts the engine the way the node agent would
(the llamacpp engine driver's command, CPU only, one slot) on the bundled model and a free loopback port,
waits for /health, asks for a one-token completion, stops it and exits 0. On failure it exits 1 and
prints how the engine ended, what that means, what to do, and the last lines of the engine's output.

`make vllm` runs the vLLM check on the environment it just built, before it puts it in place: the
vllm engine driver's command for a one-thread CPU replica (`device: cpu`) of the prepared model, through
the environment's Python (the API server module), on a free loopback port; vLLM takes about 70 s to
become healthy on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import requests

from llmgw.catalog import Model, Profile
from llmgw.engines.base import EngineUnavailable, LaunchContext, LaunchSpec
from llmgw.engines.llamacpp import DEFAULT_MODEL, LlamaCppDriver
from llmgw.engines.vllm import VllmDriver
from llmgw.proc.exitstatus import describe_exit
from llmgw.proc.ports import free_port

HOST = "127.0.0.1"
TAIL_LINES = 15
STOP_GRACE = 10.0
REBUILD = ("rebuild the engine on this machine with `make clean-engine install`, or set LLMGW_LLAMA_SERVER "
           "to a llama-server that runs here")
# What to do, by the signal the engine died of; any other failure gets the generic advice.
_ADVICE = {
    signal.SIGILL: "The binary was built for CPU instructions this machine lacks (llmgw's build needs AVX2, FMA "
                   f"and F16C and uses no AVX-512 or AMX; see docs/engines.md): {REBUILD}.",
    signal.SIGKILL: "Free some memory (the bundled model needs a few hundred MB) and run `make install` again.",
}
_GENERIC_ADVICE = f"Read the engine's output below; if the binary itself is broken, {REBUILD}."


def advice(exit_signal: int | None) -> str:
    """What to do about llama-server dying this way (the install check and `llmgw up` both say it)."""
    return _ADVICE.get(exit_signal, _GENERIC_ADVICE)


@dataclass(frozen=True)
class Failure:
    """What went wrong: the stage that failed, the engine's exit (if it ended) and its last output."""

    stage: str  # "starting", "waiting for /health" or "answering a one-token completion"
    detail: str = ""
    exit_code: int | None = None
    exit_signal: int | None = None
    output_tail: str = ""


VLLM_ADVICE = ("Read vLLM's output below; `make clean-vllm vllm` builds its environment again (a half-built one "
               "is never used).")
# What `make vllm` prepares in its directory (llmgw/engines/vllm_prepare.py makes the model and adapter).
VLLM_PYTHON = "env/bin/python"
VLLM_MODEL = "models/SmolLM2-135M-Instruct"
VLLM_ADAPTER = "adapters/smollm2-pirate"


def failure_message(binary: str, failure: Failure, task: str = "the install check", engine: str = "llama-server",
                    what_to_do: str | None = None) -> str:
    """The text a user reads when `task` fails: what happened, what it means, what to do."""
    ended = failure.exit_code is not None or failure.exit_signal is not None
    what = f"{engine} ({binary}) failed {task} while {failure.stage}"
    lines = [f"{what}: {describe_exit(failure.exit_code, failure.exit_signal)}" if ended else what]
    if failure.detail:
        lines.append(failure.detail)
    lines.append(what_to_do or advice(failure.exit_signal))
    if failure.output_tail:
        lines += ["last lines of its output:", *("  " + ln for ln in failure.output_tail.splitlines())]
    return "\n".join(lines)


def launch_spec(binary: str | None, model: str | None, port: int, environ: Mapping[str, str],
                args: tuple[str, ...] = ()) -> LaunchSpec:
    """The llamacpp engine driver's command for a one-slot CPU replica of `model` (default: the bundled SmolLM2),
    with extra llama-server `args`."""
    env = dict(environ)
    if binary:
        env["LLMGW_LLAMA_SERVER"] = binary
    profile = Profile(name="selfcheck", engine="llamacpp", capacity=1, args=list(args))
    m = Model(name="selfcheck", source=model or DEFAULT_MODEL, profiles=[profile])
    return LlamaCppDriver(environ=env).command(
        LaunchContext(replica_id="selfcheck", model=m, profile=profile, host=HOST, port=port))


def vllm_launch_spec(directory: Path, port: int, environ: Mapping[str, str]) -> LaunchSpec:
    """The vllm engine driver's command for a one-thread CPU replica of the model `make vllm` prepared in
    `directory`, run by that environment's Python."""
    env = {**environ, "LLMGW_VLLM_PYTHON": str(directory / VLLM_PYTHON)}
    env.pop("LLMGW_VLLM", None)
    profile = Profile(name="selfcheck", engine="vllm", device="cpu", threads=1, args=["--max-model-len", "2048"])
    m = Model(name="selfcheck", source=str(directory / VLLM_MODEL), profiles=[profile])
    return VllmDriver(environ=env).command(
        LaunchContext(replica_id="selfcheck", model=m, profile=profile, host=HOST, port=port))


def tail(path: Path, lines: int = TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class Engine:
    """One llama-server in its own session, output to `log`; `stop()` ends the whole group."""

    def __init__(self, spec: LaunchSpec, log: Path):
        self.spec, self.log = spec, log
        self.url = f"http://{HOST}:{spec.argv[spec.argv.index('--port') + 1]}"
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(list(spec.argv), env={**os.environ, **spec.env}, stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)

    def exit_status(self) -> tuple[int | None, int | None] | None:
        """(exit_code, exit_signal) once the engine has ended, else None."""
        rc = self.proc.poll()
        if rc is None:
            return None
        return (rc, None) if rc >= 0 else (None, -rc)

    def wait_healthy(self, timeout: float) -> Failure | None:
        """None once /health answers 200; else why not (the engine ended, or the time ran out)."""
        deadline = time.monotonic() + timeout
        while True:
            ended = self.exit_status()
            if ended:
                return Failure("waiting for /health", exit_code=ended[0], exit_signal=ended[1],
                               output_tail=tail(self.log))
            try:
                if requests.get(self.url + self.spec.health_path, timeout=2).status_code == 200:
                    return None
            except requests.RequestException:
                pass  # not listening yet
            if time.monotonic() >= deadline:
                return Failure("waiting for /health", f"no 200 from {self.url}{self.spec.health_path} "
                               f"within {timeout:g} s", output_tail=tail(self.log))
            time.sleep(0.1)

    def stop(self) -> None:
        for sig, wait in ((signal.SIGTERM, STOP_GRACE), (signal.SIGKILL, None)):
            if self.proc.poll() is not None:
                return
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass  # already gone
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue


def one_token(engine: Engine) -> Failure | None:
    """Ask for a one-token completion; None if the engine produced it."""
    try:
        r = requests.post(engine.url + "/v1/completions", json={"model": "selfcheck", "prompt": "Hello",
                                                                "max_tokens": 1}, timeout=60)
        tokens = r.json().get("usage", {}).get("completion_tokens") if r.ok else None
        problem = None if tokens == 1 else f"HTTP {r.status_code}: {r.text[:300]}"
    except (requests.RequestException, ValueError) as e:
        problem = f"no answer: {e}"
    if problem is None:
        return None
    try:
        engine.proc.wait(2)  # a request that killed the engine: let its exit status arrive
    except subprocess.TimeoutExpired:
        pass
    code, sig = engine.exit_status() or (None, None)
    ended = code is not None or sig is not None
    return Failure("answering a one-token completion", "" if ended else problem, exit_code=code,
                   exit_signal=sig, output_tail=tail(engine.log))


def check(spec: LaunchSpec, timeout: float, workdir: Path, log: str = "llama-server.log") -> Failure | None:
    try:
        engine = Engine(spec, workdir / log)
    except OSError as e:
        return Failure("starting", str(e))
    try:
        return engine.wait_healthy(timeout) or one_token(engine)
    finally:
        engine.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m llmgw.engines.selfcheck", description=__doc__.split("\n\n")[0])
    ap.add_argument("--binary", help="llama-server to check (default: the one llmgw's agent would run)")
    ap.add_argument("--model", help=f"GGUF file or pkg:<package>/<file> (default: {DEFAULT_MODEL})")
    ap.add_argument("--timeout", type=float, help="seconds to wait for /health (default: 120; vLLM 600)")
    ap.add_argument("--vllm", metavar="DIR", type=Path,
                    help="check the vLLM CPU environment `make vllm` prepared in DIR instead of llama-server")
    args = ap.parse_args(argv)
    if args.vllm:
        return check_vllm(args.vllm, args.timeout or 600.0)
    args.timeout = args.timeout or 120.0
    try:
        spec = launch_spec(args.binary, args.model, free_port(HOST), os.environ)
    except EngineUnavailable as e:
        print(f"llama-server install check: {e}", file=sys.stderr)
        return 1
    binary = spec.argv[0]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="llmgw-selfcheck-") as d:
        failure = check(spec, args.timeout, Path(d))
    if failure:
        print(failure_message(binary, failure), file=sys.stderr)
        return 1
    print(f"llama-server install check: {binary} answered a one-token completion "
          f"({time.monotonic() - started:.1f} s)")
    return 0


def check_vllm(directory: Path, timeout: float) -> int:
    python = directory / VLLM_PYTHON
    if not python.is_file() or not (directory / VLLM_MODEL / "config.json").is_file():
        print(f"vLLM install check: {directory} has no {VLLM_PYTHON} or no {VLLM_MODEL}/config.json: "
              f"run `make vllm`", file=sys.stderr)
        return 1
    spec = vllm_launch_spec(directory, free_port(HOST), os.environ)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="llmgw-selfcheck-") as d:
        failure = check(spec, timeout, Path(d), log="vllm.log")
    if failure:
        print(failure_message(str(python), failure, engine="vLLM", what_to_do=VLLM_ADVICE), file=sys.stderr)
        return 1
    print(f"vLLM install check: {python} -m {spec.argv[2]} answered a one-token completion "
          f"({time.monotonic() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
