"""Settings read from the environment."""

import pytest

from llmgw.config import Settings
from llmgw.errors import ConfigError


def test_state_dir_is_absolute_even_when_given_relative(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert Settings.from_env({}).state_dir == tmp_path / ".llmgw"
    assert Settings.from_env({"LLMGW_STATE_DIR": "state"}).state_dir == tmp_path / "state"


@pytest.mark.parametrize("env,var", [
    ({"LLMGW_PORT_RANGE": "2000"}, "LLMGW_PORT_RANGE"),
    ({"LLMGW_PORT_RANGE": "30-20"}, "LLMGW_PORT_RANGE"),
    ({"LLMGW_HEARTBEAT_TTL": "soon"}, "LLMGW_HEARTBEAT_TTL"),
    ({"LLMGW_RECONCILE_INTERVAL": "0"}, "LLMGW_RECONCILE_INTERVAL"),
    ({"LLMGW_NODE_LABELS": "gpu"}, "LLMGW_NODE_LABELS"),
])
def test_bad_values_name_their_variable(env, var):
    with pytest.raises(ConfigError) as e:
        Settings.from_env(env)
    assert e.value.variable == var
