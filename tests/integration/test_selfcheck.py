"""The install check (`python -m llmgw.engines.selfcheck`) on real processes: it passes on the installed
llama-server, and fails cleanly, naming the signal, on stand-ins that die or never become healthy."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from llmgw.engines.base import EngineUnavailable
from llmgw.engines.selfcheck import launch_spec


def selfcheck(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmgw.engines.selfcheck", *args], capture_output=True,
                          text=True, timeout=180)


@pytest.fixture
def standin(tmp_path):
    """Write an executable stand-in for llama-server; returns (its path, a model file it is given)."""
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")

    def make(body: str):
        path = tmp_path / "llama-server"
        path.write_text("#!/bin/sh\n" + body)
        path.chmod(0o755)
        return str(path), str(model)
    return make


def test_an_engine_killed_by_sigill_fails_the_check_with_the_signal_in_words(standin):
    binary, model = standin('echo "load_tensors: loading model tensors"\nkill -ILL $$\n')
    r = selfcheck("--binary", binary, "--model", model)
    assert r.returncode == 1
    assert f"llama-server ({binary}) failed the install check" in r.stderr
    assert "killed by SIGILL (illegal instruction: the engine binary uses CPU instructions this machine " \
           "cannot run)" in r.stderr
    assert "make clean-engine install" in r.stderr and "LLMGW_LLAMA_SERVER" in r.stderr
    assert "load_tensors: loading model tensors" in r.stderr  # the engine's last output
    assert "Traceback" not in r.stderr


def test_an_engine_that_never_gets_healthy_is_stopped_and_reported(standin):
    binary, model = standin("echo listening nowhere\nexec sleep 300\n")
    r = selfcheck("--binary", binary, "--model", model, "--timeout", "1")
    assert r.returncode == 1
    assert "while waiting for /health" in r.stderr and "within 1 s" in r.stderr
    assert "listening nowhere" in r.stderr
    # The sleeping stand-in was stopped (the leak detector fails the test otherwise).


STANDIN_SERVER = """
import http.server, os, signal, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def do_POST(self):
        print("computing the first token", flush=True)
        os.kill(os.getpid(), signal.SIGSEGV)
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def test_an_engine_that_dies_answering_the_completion_is_reported(standin, tmp_path):
    """Healthy first, then killed by SIGSEGV at the first request (a kernel that faults when used)."""
    server = tmp_path / "server.py"
    server.write_text(STANDIN_SERVER)
    binary, model = standin(f'exec "{sys.executable}" "{server}" "$@"\n')
    r = selfcheck("--binary", binary, "--model", model)
    assert r.returncode == 1
    assert "while answering a one-token completion: killed by SIGSEGV (segmentation fault" in r.stderr
    assert "computing the first token" in r.stderr


def test_a_missing_binary_is_a_clear_error(tmp_path):
    r = selfcheck("--binary", str(tmp_path / "nope"))
    assert r.returncode == 1
    assert f"LLMGW_LLAMA_SERVER={tmp_path / 'nope'} is not a file" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.slow
@pytest.mark.llamacpp
def test_the_installed_engine_passes():
    try:
        launch_spec(None, None, 0, os.environ)
    except EngineUnavailable as e:
        pytest.skip(f"llama.cpp is not available here: {e}")
    r = selfcheck()
    assert r.returncode == 0, r.stderr
    assert "answered a one-token completion" in r.stdout
