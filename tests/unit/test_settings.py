"""Settings read from the environment, and the docs tables that list them."""

import re
from pathlib import Path

import pytest

from gateway.config import GatewaySettings, GunicornSettings, RoutingConfig, RoutingTuning
from llmgw.batch.config import BatchSettings
from llmgw.errors import ConfigError
from llmgw.settings import ControlSettings, EnvSettings, Settings, variables
from workers.agent.config import AgentSettings

ROOT = Path(__file__).resolve().parents[2]
# Every settings class of every process role; each names the page whose table lists its variables.
CLASSES = [Settings, ControlSettings, AgentSettings, GatewaySettings, RoutingConfig, RoutingTuning, GunicornSettings,
           BatchSettings]


def test_state_dir_is_absolute_even_when_given_relative(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert Settings.from_env({}).state_dir == tmp_path / ".llmgw"
    assert Settings.from_env({"LLMGW_STATE_DIR": "state"}).state_dir == tmp_path / "state"


@pytest.mark.parametrize("cls,env,var", [
    (AgentSettings, {"LLMGW_PORT_RANGE": "2000"}, "LLMGW_PORT_RANGE"),
    (AgentSettings, {"LLMGW_PORT_RANGE": "30-20"}, "LLMGW_PORT_RANGE"),
    (AgentSettings, {"LLMGW_HEARTBEAT_TTL": "soon"}, "LLMGW_HEARTBEAT_TTL"),
    (ControlSettings, {"LLMGW_RECONCILE_INTERVAL": "0"}, "LLMGW_RECONCILE_INTERVAL"),
    (AgentSettings, {"LLMGW_NODE_LABELS": "gpu"}, "LLMGW_NODE_LABELS"),
    (GunicornSettings, {"LLMGW_GATEWAY_WORKERS": "two"}, "LLMGW_GATEWAY_WORKERS"),
])
def test_bad_values_name_their_variable(cls, env, var):
    with pytest.raises(ConfigError) as e:
        cls.from_env(env)
    assert e.value.variable == var


@pytest.mark.parametrize("env,reason", [
    ({"LLMGW_HEARTBEAT_TTL": "soon"}, "LLMGW_HEARTBEAT_TTL: expected seconds, got 'soon'"),
    ({"LLMGW_HEARTBEAT_TTL": "0"}, "LLMGW_HEARTBEAT_TTL: must be positive"),
    ({"LLMGW_AGENT_STOP_GRACE": "-1"}, "LLMGW_AGENT_STOP_GRACE: must not be negative"),
    ({"LLMGW_AGENT_LOG_KEEP": "many"}, "LLMGW_AGENT_LOG_KEEP: expected an integer, got 'many'"),
    ({"LLMGW_PORT_RANGE": "2000"}, "LLMGW_PORT_RANGE: expected START-END, got '2000'"),
    ({"LLMGW_NODE_LABELS": "gpu"}, "LLMGW_NODE_LABELS: expected key=value, got 'gpu'"),
    # every bad variable at once, not only the first
    ({"LLMGW_AGENT_TICK": "x", "LLMGW_AGENT_PROBE_FAILURES": "0"},
     "LLMGW_AGENT_TICK: expected seconds, got 'x'; LLMGW_AGENT_PROBE_FAILURES: must be at least 1, got 0"),
])
def test_messages_say_what_is_wrong(env, reason):
    with pytest.raises(ConfigError) as e:
        AgentSettings.from_env(env)
    assert str(e.value) == reason


def test_names_defaults_and_empty_values():
    assert Settings.from_env({"REDIS_URL": "redis://a:1/0"}).redis_url == "redis://a:1/0"
    both = {"REDIS_URL": "redis://a:1/0", "LLMGW_REDIS_URL": "redis://b:1/0"}
    assert Settings.from_env(both).redis_url == "redis://b:1/0"
    # An empty variable is unset (the next spelling, or the default, applies) ...
    assert Settings.from_env({"LLMGW_REDIS_URL": "", "REDIS_URL": "redis://a:1/0"}).redis_url == "redis://a:1/0"
    assert AgentSettings.from_env({"LLMGW_AGENT_TICK": ""}).tick == 0.5
    # ... except where empty says something: no GPUs, rather than "discover them".
    assert AgentSettings.from_env({"LLMGW_NODE_GPUS": ""}).node_gpus == ""
    assert AgentSettings.from_env({}).node_gpus is None
    s = AgentSettings.from_env({"LLMGW_NODE_LABELS": "zone=a, rack = 3", "LLMGW_PORT_RANGE": "100-200"})
    assert s.node_labels == {"zone": "a", "rack": "3"} and s.port_range == (100, 200)
    g = GatewaySettings.from_env({"LLMGW_GATEWAY_EJECT_FOR": "0", "LLMGW_GATEWAY_SEED": "7"})
    assert g.routing.eject_for == 0 and g.seed == 7
    assert GunicornSettings.from_env({"PORT": "9000"}).address == "127.0.0.1:9000"
    assert GunicornSettings.from_env({"PORT": "9000", "LLMGW_GATEWAY_BIND": "0.0.0.0:1"}).address == "0.0.0.0:1"


def test_constructing_directly_reads_no_environment(monkeypatch):
    monkeypatch.setenv("LLMGW_NODE", "from-the-environment")
    monkeypatch.setenv("LLMGW_AGENT_TICK", "9")
    assert Settings(node_name="a").node_name == "a"
    assert AgentSettings().tick == 0.5
    assert AgentSettings.from_env().tick == 9 and Settings.from_env().node_name == "from-the-environment"


# --- the docs tables ---------------------------------------------------------------------------------
def own_variables(cls: type[EnvSettings]) -> list[str]:
    """The variables of the fields `cls` declares itself (inherited ones are its base's to document)."""
    inherited = {n for base in cls.__mro__[1:] if isinstance(base, type) and issubclass(base, EnvSettings)
                 for n in base.model_fields}
    return [variables(f)[0] for n, f in cls.model_fields.items() if n not in inherited and variables(f)]


def table_variables(page: str) -> set[str]:
    """Every `VARIABLE` in the first cell of a table row of `page` (`| `A` / `B` | default | meaning |`)."""
    out = set()
    for line in (ROOT / page).read_text().splitlines():
        cells = line.split("|")
        if line.startswith("|") and len(cells) >= 5:
            out |= set(re.findall(r"`([A-Z][A-Z0-9_]*)`", cells[1]))
    return out


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_variable_has_a_row_in_its_docs_table(cls):
    missing = [v for v in own_variables(cls) if v not in table_variables(cls.docs)]
    assert not missing, f"{cls.docs} has no knob table row (variable | default | meaning) for {missing}"


def test_tuning_coefficients_have_a_table_of_their_own():
    """docs/gateway.md says which knobs are settings and which are the cost model's tuning: no table
    mixes RoutingTuning's variables with the settings'."""
    tuning = set(own_variables(RoutingTuning))
    tables, rows = [], set()
    for line in [*(ROOT / RoutingTuning.docs).read_text().splitlines(), ""]:
        cells = line.split("|")
        if line.startswith("|") and len(cells) >= 5:
            rows |= set(re.findall(r"`([A-Z][A-Z0-9_]*)`", cells[1]))
        elif rows:
            tables, rows = [*tables, rows], set()
    assert any(t and t <= tuning for t in tables), "no table of the tuning coefficients alone"
    mixed = [sorted(t) for t in tables if t & tuning and not t <= tuning]
    assert not mixed, f"a table mixes settings with tuning coefficients: {mixed}"


def test_every_documented_llmgw_variable_is_read_by_a_settings_class():
    known = {v for cls in CLASSES for f in cls.model_fields.values() for v in variables(f)}
    pages = ["README.md", *(str(p.relative_to(ROOT)) for p in sorted((ROOT / "docs").glob("*.md")))]
    stale = {f"{page}: {v}" for page in pages for v in table_variables(page)
             if v.startswith("LLMGW_") and v not in known}
    assert not stale, f"table rows name variables nothing reads: {sorted(stale)}"


def test_tls_files_are_checked_at_start_up(tmp_path):
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_text("x")
    key.write_text("y")
    both = GunicornSettings.from_env({"LLMGW_GATEWAY_CERTFILE": str(cert), "LLMGW_GATEWAY_KEYFILE": str(key)})
    assert (both.certfile, both.keyfile, both.scheme) == (cert, key, "https")
    assert GunicornSettings.from_env({}).scheme == "http"
    with pytest.raises(ConfigError, match="LLMGW_GATEWAY_KEYFILE: HTTPS needs it too"):
        GunicornSettings.from_env({"LLMGW_GATEWAY_CERTFILE": str(cert)})
    with pytest.raises(ConfigError, match="LLMGW_GATEWAY_CERTFILE: cannot read .*missing.pem"):
        GunicornSettings.from_env({"LLMGW_GATEWAY_CERTFILE": str(tmp_path / "missing.pem"),
                                   "LLMGW_GATEWAY_KEYFILE": str(key)})
