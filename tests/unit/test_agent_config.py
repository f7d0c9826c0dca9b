"""Agent knobs and the queue check of the bootstep."""

from __future__ import annotations

import pytest

from llmgw.errors import ConfigError
from workers.agent.config import AgentSettings
from workers.agent.step import agent_queue


def test_defaults_and_overrides():
    assert AgentSettings.from_env({}) == AgentSettings()
    c = AgentSettings.from_env({"LLMGW_AGENT_KEEP_ENGINES": "1", "LLMGW_AGENT_BACKOFF_CAP": "30",
                              "LLMGW_AGENT_LIVENESS_TIMEOUT": "0", "LLMGW_AGENT_LOG_KEEP": "5"})
    assert c.keep_engines and c.backoff_cap == 30 and c.liveness_timeout == 0 and c.log_keep == 5
    assert c.policy.backoff_cap == 30


@pytest.mark.parametrize("text,size", [("500GiB", 500 * 1024 ** 3), ("800G", 800 * 10 ** 9), ("1.5TiB", int(1.5 * 1024 ** 4)),
                                       ("123", 123), ("64 MiB", 64 * 1024 ** 2)])
def test_weights_knobs(text, size, tmp_path):
    c = AgentSettings.from_env({"LLMGW_WEIGHTS_BUDGET": text, "LLMGW_STATE_DIR": str(tmp_path), "LLMGW_DOWNLOADS": "3"})
    assert (c.weights_budget, c.downloads, c.weights_dir) == (size, 3, tmp_path / "weights")
    assert AgentSettings.from_env({"LLMGW_WEIGHTS_DIR": "/w"}).weights_dir.as_posix() == "/w"
    assert AgentSettings.from_env({}).weights_budget is None


@pytest.mark.parametrize("env,var", [
    ({"LLMGW_AGENT_TICK": "x"}, "LLMGW_AGENT_TICK"),
    ({"LLMGW_AGENT_TICK": "0"}, "LLMGW_AGENT_TICK"),
    ({"LLMGW_AGENT_KEEP_ENGINES": "maybe"}, "LLMGW_AGENT_KEEP_ENGINES"),
    ({"LLMGW_AGENT_BACKOFF_CAP": "0.5"}, "LLMGW_AGENT_BACKOFF_CAP"),
    ({"LLMGW_AGENT_LOG_MAX_BYTES": "1MB"}, "LLMGW_AGENT_LOG_MAX_BYTES"),
    ({"LLMGW_WEIGHTS_BUDGET": "lots"}, "LLMGW_WEIGHTS_BUDGET"),
    ({"LLMGW_WEIGHTS_BUDGET": "0"}, "LLMGW_WEIGHTS_BUDGET"),
    ({"LLMGW_DOWNLOADS": "0"}, "LLMGW_DOWNLOADS"),
])
def test_bad_values_name_the_variable(env, var):
    with pytest.raises(ConfigError, match=var):
        AgentSettings.from_env(env)


def test_agent_queue():
    assert agent_queue(["control"], "a") is None
    assert agent_queue(["node-a"], "a") == "node-a"
    assert agent_queue(["control", "node-a"], "a") == "node-a"
    with pytest.raises(ConfigError, match="node-b"):
        agent_queue(["node-b"], "a")


def test_one_agent_per_state_dir(tmp_path):
    import subprocess
    import sys

    from workers.agent.step import acquire_node_lock

    held = acquire_node_lock(tmp_path, "a")
    try:
        # flock is per open file description: a second process must be refused.
        code = (
            "import sys; from workers.agent.step import acquire_node_lock\n"
            "from llmgw.errors import ConfigError\n"
            f"try:\n    acquire_node_lock({str(tmp_path)!r}, 'a')\nexcept ConfigError as e:\n"
            "    print(e); sys.exit(3)\n"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
        assert out.returncode == 3 and "another node agent (node a, pid" in out.stdout
    finally:
        held.close()
    again = acquire_node_lock(tmp_path, "a")  # released: the next agent takes over
    again.close()


def test_a_forked_child_does_not_keep_the_lock(tmp_path):
    import os

    from workers.agent.step import acquire_node_lock

    held = acquire_node_lock(tmp_path, "a")
    r, w = os.pipe()  # child -> parent: "the at-fork hooks have run"
    block_r, block_w = os.pipe()  # nothing is ever written: the child blocks on it until killed
    pid = os.fork()
    if pid == 0:  # the child: like a prefork pool process, it lives on without the lock
        try:
            os.write(w, b"x")  # the at-fork hooks have run by now
            os.read(block_r, 1)
        finally:
            os._exit(0)
    try:
        assert os.read(r, 1) == b"x"
        held.close()  # the "agent" dies; the child is still alive
        # However slow this process is, the child is still there when the lock is taken again.
        assert os.waitpid(pid, os.WNOHANG) == (0, 0), "the forked child exited early: the test proves nothing"
        again = acquire_node_lock(tmp_path, "a")
        assert os.waitpid(pid, os.WNOHANG) == (0, 0)  # still alive while the lock was taken
        again.close()
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        for fd in (r, w, block_r, block_w):
            os.close(fd)


def test_supervision_defaults_have_one_source():
    from workers.agent.supervisor import Policy

    assert AgentSettings().policy == Policy()
